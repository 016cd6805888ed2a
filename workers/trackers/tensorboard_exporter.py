"""The TensorBoard writer: one event-file directory per attempt."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from workers.trackers.series import (
    ATTEMPT_START,
    Event,
    anomaly_line,
    as_number,
    checkpoint_line,
    end_line,
    event_step,
    scalars,
    start_line,
)


class TensorBoardExporter:
    """Event files through ``torch.utils.tensorboard.SummaryWriter`` (needs the ``tensorboard`` package)."""

    name = "tensorboard"

    def __init__(self, run_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter  # ImportError: the extra is not installed

        self._writer_cls = SummaryWriter
        self.run_dir = run_dir
        run_dir.mkdir(parents=True, exist_ok=True)
        self._writers: dict[int, Any] = {}
        self._starts: dict[int, Event] = {}

    def _writer(self, attempt: int, step: int) -> Any:
        w = self._writers.get(attempt)
        if w is None:
            # the attempt's directory may hold events already (Ray Train restarted this worker group): drop what
            # was written from this process's first step on (TensorBoard's purge_step), then continue
            w = self._writer_cls(str(self.run_dir / f"attempt-{attempt}"), purge_step=step or None, flush_secs=2)
            self._writers[attempt] = w
            start = self._starts.pop(attempt, None)
            if start is not None:
                w.add_text("attempt", start_line(start.data), step, walltime=start.ts_ms / 1000.0)
        return w

    def write(self, events: list[Event]) -> None:
        import torch

        for e in events:
            if e.type == ATTEMPT_START:  # written with the attempt's first step, once that is known
                self._starts[e.attempt] = e
                continue
            step = event_step(e.data)
            w = self._writer(e.attempt, step)
            wall = e.ts_ms / 1000.0
            for tag, value in scalars(e.type, e.data).items():
                w.add_scalar(tag, value, step, walltime=wall)
            if e.type == "layer_stats":
                norms = [v for v in map(as_number, (e.data.get("layer_grad_norms") or {}).values()) if v is not None]
                if norms:
                    w.add_histogram("layer_grad_norms", torch.tensor(norms, dtype=torch.float64), step, walltime=wall)
                if e.data.get("diagnosis"):
                    w.add_text("diagnosis", str(e.data["diagnosis"]), step, walltime=wall)
            elif e.type == "anomaly":
                w.add_text(f"anomalies/{e.data.get('kind') or 'unknown'}", anomaly_line(e.data), step, walltime=wall)
            elif e.type == "checkpoint":
                w.add_text("checkpoints", checkpoint_line(e.data), step, walltime=wall)
            elif e.type == "end":
                w.add_text("attempt", end_line(e.data), step, walltime=wall)

    def close(self, final: Event | None) -> None:
        for w in self._writers.values():
            w.close()
        self._writers.clear()
