"""The tracker export: rank 0's event stream teed to TensorBoard event files and MLflow (``telemetry.export``).

``TrackerExport.open(spec, ctx)`` (rank 0, a recipe that asks for it) starts one background thread for the worker
group; ``export.tee(sink, spec)`` wraps the attempt's sink. ``emit`` hands a copy of each event to a bounded
queue (``put_nowait``: a full queue drops the event and says so once) and passes it on to the real sink, so the
training step never waits on a tracker. The thread creates the exporters on their first event (imports, mkdir,
the MLflow run) and writes; an exporter that raises is logged once, with the reason, and switched off for the
rest of the worker group; training and the other exporter go on.

What the trackers receive (see ``docs/telemetry.md`` for the reader's side):

- TensorBoard: one directory per attempt, ``<root>/[<telemetry.export_dir>/]run-<id>/attempt-<n>/``, so
  TensorBoard shows each attempt as its own run (its own colour) and a retry that re-runs steps 50-60 after a
  rollback draws a second line instead of rewriting the first. A worker group that Ray Train restarts within an
  attempt continues in the same directory with ``purge_step`` at its first step (TensorBoard drops the orphaned
  tail). Scalars: ``loss``, ``eval_loss`` (``eval`` events), ``grad_norm/pre_clip``, ``grad_norm/post_clip``,
  ``lr``, ``loss_scale``, ``throughput``, ``update_ratio``, ``layer_grad_norm/<param>``,
  ``block_grad_norm/<i>``; histogram ``layer_grad_norms`` (the per-parameter norms of a ``layer_stats`` step);
  text ``anomalies/<kind>``, ``checkpoints``, ``diagnosis``, ``attempt`` (its start and its end).
- MLflow: one MLflow run per Ballast run (``ballast-run-<id>``, tag ``ballast.run_id``; found again by a later
  worker group), the same scalars as metrics named ``attempt_<n>/<series>`` with the training step as the MLflow
  step; anomalies and checkpoints as text artifacts ``attempt_<n>/anomalies.txt`` / ``checkpoints.txt``; each
  attempt's start and outcome as tags ``ballast.attempt_<n>.*``.

Unknown event types are skipped (a newer trainer may send more).

This module is the queue and its thread; ``series`` turns events into scalars and text, and
``tensorboard_exporter`` / ``mlflow_exporter`` write them.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from contracts.export import ExportTargets
from contracts.wire import AttemptSpec
from workers.context import WorkerContext
from workers.sinks import EventSink
from workers.trackers.mlflow_exporter import MlflowExporter
from workers.trackers.series import ATTEMPT_START, Event, Exporter, scalars
from workers.trackers.tensorboard_exporter import TensorBoardExporter

log = logging.getLogger("ballast.trackers")

QUEUE_EVENTS = 10_000
"""Events buffered for the trackers; past that, events are dropped (and that is said once)."""
CLOSE_TIMEOUT_S = 30.0
"""How long the end of a worker group waits for the trackers to write what is queued."""
BATCH_SECONDS = 1.0
"""The writer thread gathers events this long before writing them (at most ``BATCH_EVENTS``)."""
BATCH_EVENTS = 2000


# ------------------------------------------------------------------------------------------ the thread
def run_key(spec: AttemptSpec) -> str:
    """A run's name in the trackers: ``run-<id>`` in the service, ``local-<recipe>-<time>`` without one."""
    if spec.run_id is not None:
        return f"run-{spec.run_id}"
    return f"local-{spec.recipe.name}-{time.strftime('%Y%m%d-%H%M%S')}"


def _factories(spec: AttemptSpec, targets: ExportTargets, key: str) -> dict[str, Callable[[], Exporter]]:
    telemetry = spec.recipe.telemetry
    root = Path(targets.tensorboard_root)
    if telemetry.export_dir:
        root = root / telemetry.export_dir
    tags = {"ballast.recipe": spec.recipe.name}
    if spec.run_id is not None:
        tags["ballast.run_id"] = str(spec.run_id)
    experiment = telemetry.mlflow_experiment or targets.mlflow_experiment
    makers: dict[str, Callable[[], Exporter]] = {
        "tensorboard": lambda: TensorBoardExporter(root / key),
        "mlflow": lambda: MlflowExporter(targets, experiment=experiment, run_key=key, run_name=f"ballast-{key}",
                                         tags=tags),
    }
    return {str(name): makers[str(name)] for name in telemetry.export}


class TrackerExport:
    """The trackers of one worker group on rank 0: a bounded queue and the thread that writes it out."""

    def __init__(self, factories: Mapping[str, Callable[[], Exporter]]) -> None:
        self._factories = dict(factories)
        self._exporters: dict[str, Exporter] = {}
        self.disabled: dict[str, str] = {}
        """Exporter name → why it was switched off (one line)."""
        self.dropped = 0
        self._queue: queue.Queue[Event | None] = queue.Queue(maxsize=QUEUE_EVENTS)
        self._last_end: Event | None = None
        self._thread = threading.Thread(target=self._run, name="ballast-trackers", daemon=True)
        self._thread.start()

    @classmethod
    def open(cls, spec: AttemptSpec, ctx: WorkerContext) -> TrackerExport | None:
        """The export the recipe asks for, on rank 0; None when it asks for none (or on other ranks)."""
        if not ctx.is_main or not spec.recipe.telemetry.export:
            return None
        try:
            targets = spec.export or ExportTargets.from_env()
            return cls(_factories(spec, targets, run_key(spec)))
        except Exception as exc:  # noqa: BLE001 - no export is better than no training
            log.warning("tracker export off for this worker group: %s: %s", type(exc).__name__, exc)
            return None

    def tee(self, sink: EventSink | None, spec: AttemptSpec, resume: str | None) -> TeeSink:
        """The attempt's sink: events go to ``sink`` (if any) and to the trackers as attempt ``spec.attempt``,
        which resumes from ``resume`` (a checkpoint path or URI; None: from initialisation)."""
        tee = TeeSink(sink, self, spec.attempt)
        self.submit(spec.attempt, ATTEMPT_START, {"attempt": spec.attempt, "resume_from": resume,
                                           "rewarm_steps": spec.rewarm_steps, "data_offset": spec.data_offset,
                                           "step": _resume_step(resume)})
        return tee

    def submit(self, attempt: int, type: str, data: Mapping[str, Any]) -> None:
        """Never blocks and never raises: a full queue drops the event."""
        try:
            self._queue.put_nowait(Event(attempt, type, dict(data), int(time.time() * 1000)))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1:
                log.warning("tracker export is behind: dropping events (queue of %d full)", QUEUE_EVENTS)
        except Exception as exc:  # noqa: BLE001 - an event the trackers cannot take is theirs to lose
            self.dropped += 1
            if self.dropped == 1:
                log.warning("tracker export: dropping an event it cannot queue: %s", exc)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Write what is queued (waiting at most ``timeout``) and close the trackers."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            log.warning("tracker export: could not finish writing within %.0f s", timeout)
            return
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("tracker export: could not finish writing within %.0f s", timeout)

    # --------------------------------------------------------------------------------- the thread
    def _run(self) -> None:
        done = False
        while not done:
            batch, done = self._next_batch()
            ends = [e for e in batch if e.type == "end"]
            if ends:
                self._last_end = ends[-1]
            if batch:
                self._each(partial(_write, events=batch), create=True)
        self._each(lambda exp: exp.close(self._last_end), create=False)

    def _next_batch(self) -> tuple[list[Event], bool]:
        """The events of the next ``BATCH_SECONDS`` (one MLflow call and one TensorBoard flush for many steps,
        rather than one per step), and whether the export is closing."""
        batch: list[Event] = []
        item = self._queue.get()
        deadline = time.monotonic() + BATCH_SECONDS
        while item is not None:
            batch.append(item)
            left = deadline - time.monotonic()
            if len(batch) >= BATCH_EVENTS or left <= 0:
                return batch, False
            try:
                item = self._queue.get(timeout=left)
            except queue.Empty:
                return batch, False
        return batch, True

    def _each(self, call: Callable[[Exporter], None], *, create: bool) -> None:
        for name, make in self._factories.items():
            if name in self.disabled:
                continue
            try:
                exp = self._exporters.get(name)
                if exp is None:
                    if not create:
                        continue
                    exp = self._exporters[name] = make()
                call(exp)
            except Exception as exc:  # noqa: BLE001 - a tracker must never take training down
                self._disable(name, exc)

    def _disable(self, name: str, exc: BaseException) -> None:
        hint = f" (pip install 'ballast[{name}]')" if isinstance(exc, ImportError) else ""
        self.disabled[name] = f"{type(exc).__name__}: {exc}"
        log.warning("%s export disabled for this worker group: %s%s", name, self.disabled[name], hint)
        exp = self._exporters.pop(name, None)
        if exp is not None:
            try:
                exp.close(None)
            except Exception:  # noqa: BLE001 - already reported; nothing more to say
                pass


def _write(exp: Exporter, *, events: list[Event]) -> None:
    exp.write(events)


def _resume_step(resume_from: str | None) -> int:
    """The step a resumed attempt starts at, from its checkpoint's name (``step_00000050``); 0 without one."""
    match = re.search(r"step_(\d+)/?$", resume_from or "")
    return int(match.group(1)) if match else 0


class TeeSink:
    """An ``EventSink`` that passes every event on to ``inner`` and hands a copy to the trackers."""

    def __init__(self, inner: EventSink | None, export: TrackerExport, attempt: int) -> None:
        self.inner = inner
        self.export = export
        self.attempt = attempt

    def emit(self, type: str, data: dict[str, Any]) -> None:
        if self.inner is not None:
            self.inner.emit(type, data)
        self.export.submit(self.attempt, type, data)

    def flush(self) -> None:
        if self.inner is not None:
            self.inner.flush()

    def should_stop(self) -> bool:
        return self.inner is not None and self.inner.should_stop()


__all__ = ["MlflowExporter", "TeeSink", "TensorBoardExporter", "TrackerExport", "run_key", "scalars"]
