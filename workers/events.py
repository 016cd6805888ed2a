"""What a worker tells the control plane, and the channel it tells it through.

Every event is a plain dict envelope ``{"seq": int, "type": str, "data": {...}}`` with ``seq`` increasing by one
per attempt, so the store can ingest idempotently (a redelivered event never duplicates a row). Only rank 0
emits; detector decisions are identical on all ranks because their inputs are all-reduced first.

Event types and their ``data``:

- ``metric``: step, loss, grad_norm (before clipping), grad_norm_clipped, lr, loss_scale, throughput
  (samples/s), skipped (bool)
- ``layer_stats``: step, layer_grad_norms {name: float}, update_ratio (float), diagnosis (str | None)
- ``anomaly``: step, rank, kind, detector, value, threshold, action, details {...}
- ``checkpoint``: step, uri, sha256, healthy (bool), verdict {...}, metrics {...}
- ``end``: outcome ("succeeded" | "diverged" | "cancelled"), final_step, onset_step (int | None),
  detector (str | None), value (float | None), reason (str), median_grad_norm (float | None),
  loss_scale_collapsed (bool)
"""

from __future__ import annotations

from typing import Any, Protocol

EVENT_TYPES = frozenset({"metric", "layer_stats", "anomaly", "checkpoint", "end"})


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
