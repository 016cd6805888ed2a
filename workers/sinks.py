"""Where the engine sends its events: the ``EventSink`` protocol and the in-memory ``ListSink``.

The envelope and the payloads are ``contracts/wire.py``; the Ray channel's sink is ``workers/ray_sink.py``.
Only rank 0 holds a sink.
"""

from __future__ import annotations

from typing import Any, Protocol


class EventSink(Protocol):
    """Where the engine sends events. Implementations must not block the training step."""

    def emit(self, type: str, data: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...

    def should_stop(self) -> bool:
        """True once the control plane asked this attempt to stop (cancellation)."""
        ...


class PlanningSink(EventSink, Protocol):
    """A sink that can also answer for the control plane after a rollback (in-place recovery)."""

    def request_plan(self, end_data: dict[str, Any]) -> dict[str, Any] | None:
        """The next attempt's plan for the ``end`` payload ``end_data`` (see ``workers/entry.py``), or None to
        end the attempt group."""
        ...


class StopOnlySink:
    """Passes on only the control plane's stop request: the sink of a run that must stay quiet but cancellable
    (an LR probe's candidates, ``workers/lr_probe.py``: their steps are not the attempt's)."""

    def __init__(self, sink: EventSink) -> None:
        self._sink = sink

    def emit(self, type: str, data: dict[str, Any]) -> None:
        return None

    def flush(self) -> None:
        return None

    def should_stop(self) -> bool:
        return self._sink.should_stop()


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
