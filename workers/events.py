"""Where the engine sends its events (the envelope and payloads are ``contracts/wire.py``)."""

from __future__ import annotations

from typing import Any, Protocol


class EventSink(Protocol):
    """Where the engine sends events. Implementations must not block the training step."""

    def emit(self, type: str, data: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def should_stop(self) -> bool:
        """True once the control plane asked this attempt to stop (cancellation)."""
        ...


class ListSink:
    """Keeps events in memory: for library use, `ballast train` and tests."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self._seq = 0
        self.stop_requested = False

    def emit(self, type: str, data: dict[str, Any]) -> None:
        self._seq += 1
        self.events.append({"seq": self._seq, "type": type, "data": data})

    def flush(self) -> None:
        return None

    def should_stop(self) -> bool:
        return self.stop_requested

    def of_type(self, type: str) -> list[dict[str, Any]]:
        return [e["data"] for e in self.events if e["type"] == type]
