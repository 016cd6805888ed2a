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
"""

from __future__ import annotations

import logging
import math
import queue
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from contracts.export import ExportTargets
from contracts.wire import AttemptSpec
from workers.context import WorkerContext
from workers.sinks import EventSink

log = logging.getLogger("ballast.trackers")

QUEUE_EVENTS = 10_000
"""Events buffered for the trackers; past that, events are dropped (and that is said once)."""
CLOSE_TIMEOUT_S = 30.0
"""How long the end of a worker group waits for the trackers to write what is queued."""
MLFLOW_BATCH = 1000
"""MLflow's ``log_batch`` limit on metrics per call."""
MLFLOW_TEXT_LINES = 2000
"""Lines kept in an MLflow text artifact (anomalies, checkpoints) of one attempt."""

BATCH_SECONDS = 1.0
"""The writer thread gathers events this long before writing them (at most ``BATCH_EVENTS``)."""
BATCH_EVENTS = 2000

_START = "_attempt_start"
"""The queue's own event: an attempt's first line (attempt, resume point), written before its events."""


@dataclass(frozen=True)
class Event:
    attempt: int
    type: str
    data: Mapping[str, Any]
    ts_ms: int


# ------------------------------------------------------------------------------------------ the series
def _number(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(x) else None


METRIC_SERIES = (("loss", "loss"), ("grad_norm", "grad_norm/pre_clip"), ("grad_norm_clipped", "grad_norm/post_clip"),
                 ("lr", "lr"), ("loss_scale", "loss_scale"), ("throughput", "throughput"))
"""``metric`` payload key → series name."""


def scalars(type: str, data: Mapping[str, Any]) -> dict[str, float]:
    """The scalar series one event contributes (non-finite and missing values left out)."""
    out: dict[str, float] = {}
    if type == "metric":
        pairs: Iterable[tuple[str, Any]] = ((name, data.get(key)) for key, name in METRIC_SERIES)
    elif type == "eval":
        pairs = ((k if k.startswith("eval") else f"eval/{k}", v) for k, v in data.items() if k != "step")
    elif type == "layer_stats":
        layers = data.get("layer_grad_norms") or {}
        blocks = data.get("block_grad_norms") or []
        pairs = [("update_ratio", data.get("update_ratio")),
                 *((f"layer_grad_norm/{name}", v) for name, v in layers.items()),
                 *((f"block_grad_norm/{i:02d}", v) for i, v in enumerate(blocks))]
    else:
        return out
    for name, value in pairs:
        v = _number(value)
        if v is not None:
            out[name] = v
    return out


def _fmt(x: Any) -> str:
    v = _number(x)
    return "n/a" if v is None else f"{v:.6g}"


def anomaly_line(d: Mapping[str, Any]) -> str:
    return (f"step {d.get('step')}: {d.get('kind')} ({d.get('detector')}) value {_fmt(d.get('value'))} "
            f"vs threshold {_fmt(d.get('threshold'))}, action {d.get('action')}")


def checkpoint_line(d: Mapping[str, Any]) -> str:
    health = "healthy" if d.get("healthy") else "UNHEALTHY"
    verdict = d.get("verdict") or {}
    failed = [k for k, v in verdict.items() if v is False]
    why = f" ({', '.join(failed)} failed)" if failed else ""
    return f"step {d.get('step')}: {health}{why}, sha256 {str(d.get('sha256') or '')[:12]}, {d.get('uri')}"


def end_line(d: Mapping[str, Any]) -> str:
    onset = f", onset step {d['onset_step']}" if d.get("onset_step") is not None else ""
    reason = f": {d['reason']}" if d.get("reason") else ""
    return f"ended {d.get('outcome')} after step {d.get('final_step')}{onset}{reason}"


def start_line(d: Mapping[str, Any]) -> str:
    resumed = f"resumed from {d['resume_from']}" if d.get("resume_from") else "from initialisation"
    rewarm = f", LR re-warm over {d['rewarm_steps']} steps" if d.get("rewarm_steps") else ""
    offset = f", data offset {d['data_offset']}" if d.get("data_offset") else ""
    return f"attempt {d.get('attempt')} {resumed}{rewarm}{offset}"


def _step(d: Mapping[str, Any]) -> int:
    step = d.get("step", d.get("final_step", 0))
    return int(step) if isinstance(step, int | float) and not isinstance(step, bool) else 0


# ------------------------------------------------------------------------------------------ exporters
class Exporter(Protocol):
    name: str

    def write(self, events: list[Event]) -> None: ...

    def close(self, final: Event | None) -> None: ...


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
            if e.type == _START:  # written with the attempt's first step, once that is known
                self._starts[e.attempt] = e
                continue
            step = _step(e.data)
            w = self._writer(e.attempt, step)
            wall = e.ts_ms / 1000.0
            for tag, value in scalars(e.type, e.data).items():
                w.add_scalar(tag, value, step, walltime=wall)
            if e.type == "layer_stats":
                norms = [v for v in map(_number, (e.data.get("layer_grad_norms") or {}).values()) if v is not None]
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


def _key(name: str) -> str:
    """An MLflow metric/tag/artifact-safe name (alphanumerics, ``_ - . / space``)."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", name)


class MlflowExporter:
    """One MLflow run per Ballast run through ``MlflowClient`` (needs ``mlflow`` or ``mlflow-skinny``)."""

    name = "mlflow"

    def __init__(self, targets: ExportTargets, *, experiment: str, run_key: str, run_name: str,
                 tags: Mapping[str, str]) -> None:
        from mlflow.entities import Metric, RunTag
        from mlflow.tracking import MlflowClient

        self._metric, self._tag = Metric, RunTag
        self.client = MlflowClient(tracking_uri=targets.mlflow_tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            location = None
            if targets.mlflow_artifact_root:
                location = f"{targets.mlflow_artifact_root.rstrip('/')}/{_key(experiment)}"
            exp_id = self.client.create_experiment(experiment, artifact_location=location)
        found = self.client.search_runs([exp_id], f"tags.`ballast.run_key` = '{run_key}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(exp_id, run_name=run_name, tags={"ballast.run_key": run_key, **tags})
            self.run_id = run.info.run_id
        self._texts: dict[str, list[str]] = {}
        self._tagged: set[str] = set()

    def write(self, events: list[Event]) -> None:
        metrics: list[Any] = []
        tags: dict[str, str] = {}
        dirty: set[str] = set()
        for e in events:
            prefix = f"attempt_{e.attempt}"
            step = _step(e.data)
            metrics.extend(self._metric(_key(f"{prefix}/{name}"), value, e.ts_ms, step)
                           for name, value in scalars(e.type, e.data).items())
            if e.type == "anomaly":
                self._append(f"{prefix}/anomalies.txt", anomaly_line(e.data), dirty)
                first = f"ballast.{prefix}.first_anomaly"
                if first not in self._tagged:
                    self._tagged.add(first)
                    tags[first] = anomaly_line(e.data)
            elif e.type == "checkpoint":
                self._append(f"{prefix}/checkpoints.txt", checkpoint_line(e.data), dirty)
            elif e.type == "end":
                tags[f"ballast.{prefix}.outcome"] = str(e.data.get("outcome"))
                tags[f"ballast.{prefix}.end"] = end_line(e.data)[:5000]
            elif e.type == _START:
                tags[f"ballast.{prefix}.start"] = start_line(e.data)
                tags["ballast.attempt"] = str(e.attempt)
        run_tags = [self._tag(k, v) for k, v in tags.items()]
        for i in range(0, max(len(metrics), 1), MLFLOW_BATCH):
            chunk = metrics[i:i + MLFLOW_BATCH]
            if chunk or (i == 0 and run_tags):
                self.client.log_batch(self.run_id, metrics=chunk, tags=run_tags if i == 0 else [])
        for path in sorted(dirty):
            self.client.log_text(self.run_id, "\n".join(self._texts[path]) + "\n", path)

    def _append(self, path: str, line: str, dirty: set[str]) -> None:
        """A line of a text artifact (rewritten whole when it changes: MLflow has no append), up to
        ``MLFLOW_TEXT_LINES`` lines; past that the artifact says how many more there were."""
        lines = self._texts.setdefault(path, [])
        if len(lines) < MLFLOW_TEXT_LINES:
            lines.append(line)
        elif len(lines) == MLFLOW_TEXT_LINES:
            lines.append("... more not kept here (all of them are in Ballast's store)")
        else:
            return
        dirty.add(path)

    def close(self, final: Event | None) -> None:
        """Finish the MLflow run when the last attempt of this worker group succeeded or was cancelled; after a
        divergence or a crash the orchestrator may start another attempt, which continues the same run."""
        outcome = final.data.get("outcome") if final is not None else None
        if outcome == "succeeded":
            self.client.set_terminated(self.run_id, status="FINISHED")
        elif outcome == "cancelled":
            self.client.set_terminated(self.run_id, status="KILLED")


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
        self.submit(spec.attempt, _START, {"attempt": spec.attempt, "resume_from": resume,
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
