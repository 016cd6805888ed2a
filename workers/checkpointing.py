"""Checkpointing an attempt: what a trainer's checkpoint holds, where it goes, and how a resume gets it back.

``workers/checkpoint.py`` writes and reads the files (the format is ``contracts/checkpoint.py``); this module
decides what is in them and where they go:

- ``TrainingState``: the stateful parts of one rank's trainer. A checkpoint holds the model, optimizer, loss
  scaler, detectors, clipper and eval history (rank 0's, identical on every rank; the eval history only with
  ``training.eval_interval``), each rank's RNG and comm-hook state, and the
  progress (step, data offset, attempt, world size, the pending update ratio).
- ``health_verdict``: the label every checkpoint carries (finite weights, no anomaly since the previous one, the
  loss within the loss detector's bounds, no regression of the smoothed loss nor, when an eval loss was measured
  at the checkpoint's step, of the eval loss).
- ``Checkpointer``: under ``distributed.strategy: fsdp`` every rank first writes its shards of the model and
  optimizer into a staging directory (``workers/sharded_checkpoint.py``; synchronous, a collective), which rank 0's
  write adopts. Rank 0 copies the state to host memory and hands it to a background writer
  (``workers/checkpoint_writer.py``), which writes it to the attempt's directory in a plain process, or straight to
  ``<checkpoint_uri_prefix>/step_XXXXXXXX`` under Ray Train (a local or shared path, or ``s3://`` through pyarrow,
  as Ray Train would), verifies it and, in a plain process, applies retention. Only then, on the training thread,
  is it registered: the attempt's result, the ``checkpoint`` event (how the store learns of it; nothing goes
  through ``ray.train.report``, Ballast's store owns checkpoints) and the corrupt-checkpoint fault. At most one
  write is in flight; the attempt's end (``drain``) waits for it, so the ``end`` event, the result and an
  in-place rollback's plan see only checkpoints that were written and verified.
- ``materialize``: a local directory for a checkpoint path or URI (an object-store checkpoint is downloaded
  through Ray Train's ``Checkpoint`` with the launch's ``StorageOptions``).

Under Ray Train a checkpoint's URI is ``<checkpoint_uri_prefix>/step_XXXXXXXX`` whatever the storage (a local
path, a shared mount, ``s3://``; the prefix is Ray Train's run directory, ``<storage_path>/<run_name>``): the
writer puts it there and every later reader (a resume, the scheduler's verification, reconciliation and retention)
goes through ``contracts.storage.Location``. A write is never visible half done: locally a hidden temporary
directory renamed into place, on an object store the manifest put last.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import socket
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from contracts.checkpoint import apply_retention, verify_checkpoint
from contracts.storage import Location, StorageOptions, local_dir
from contracts.wire import AttemptSpec, SavedCheckpoint, finite_or_none
from workers.checkpoint import check_state, encode_checkpoint, rng_state, set_rng_state, write_checkpoint
from workers.checkpoint_writer import BackgroundWriter, HostStaging
from workers.clipping import Clipper
from workers.comm import load_powersgd_state, powersgd_state_dict
from workers.context import WorkerContext, barrier, gather_objects
from workers.detectors import DetectorSuite, LossSummary
from workers.evaluation import EvalHistory
from workers.faults import FaultInjector
from workers.optim import apply_hyperparameters, load_optimizer_state
from workers.precision import LossScaler
from workers.sharded_checkpoint import SHARDS, shards_meta, stage_shards, staging_root, without_sharded_parts
from workers.sharding import all_finite, fsdp_enabled
from workers.sinks import EventSink
from workers.verdict import EvalEvidence, StallClock, eval_regression_limit


@dataclass(frozen=True)
class TrainingState:
    """The stateful parts of one rank's trainer: what a checkpoint holds and a resume restores.

    The model's weights are loaded by the trainer itself, before DDP wraps the module (DDP starts every rank
    from rank 0's weights); ``load_state_dict`` restores the rest.
    """

    module: nn.Module
    optimizer: torch.optim.Optimizer
    scaler: LossScaler
    detectors: DetectorSuite
    clipper: Clipper
    stall_clock: StallClock
    """The lineage's stall clock: a resume neither restarts it nor forgets how long the lineage stood still."""
    comm_state: Any = None
    """PowerSGD's state when that comm hook is on, else None."""
    evals: EvalHistory | None = None
    """The lineage's eval history when ``training.eval_interval`` is on, else None (and not in the checkpoint)."""

    def rank_part(self) -> dict[str, Any]:
        """What differs between ranks (RNG streams, PowerSGD's error feedback): gathered so each resumes its own."""
        return {"rng": rng_state(),
                "comm_hook": powersgd_state_dict(self.comm_state) if self.comm_state is not None else {}}

    @staticmethod
    def node_of(ctx: WorkerContext) -> str:
        """Where this rank runs (the Ray node id; the host name in a plain process): recorded in the manifest."""
        return ctx.node or socket.gethostname()

    def state_dict(self, per_rank: Sequence[Mapping[str, Any]], progress: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's parts (rank 0), with every rank's ``rank_part`` in rank order."""
        out = {
            "model": self.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "detectors": self.detectors.state_dict(),
            "clipper": self.clipper.state_dict(),
            "stall_clock": self.stall_clock.state_dict(),
            "comm_hook": [r["comm_hook"] for r in per_rank],
            "rng": [r["rng"] for r in per_rank],
            "progress": progress,
        }
        if self.evals is not None:
            out["evals"] = self.evals.state_dict()
        return out

    def load_state_dict(self, saved: Mapping[str, Any], *, hyperparameters: Mapping[str, Any], rank: int,
                        world_size: int, device: torch.device) -> float | None:
        """Resume optimizer, scaler, detectors, clipper, comm hook and RNG; returns the pending update ratio.

        ``hyperparameters`` (the recipe's, possibly overridden) win over the checkpoint's param groups. Per-rank
        parts come back to the same rank when the world size is unchanged; otherwise every rank takes rank 0's
        RNG and PowerSGD starts afresh.
        """
        if "optimizer" in saved:  # a sharded checkpoint's optimizer came back with its shards (load_shards)
            trainable = [p for p in self.module.parameters() if p.requires_grad]
            load_optimizer_state(self.optimizer, saved["optimizer"], trainable)
        apply_hyperparameters(self.optimizer, dict(hyperparameters))
        self.scaler.load_state_dict(saved["scaler"])
        self.detectors.load_state_dict(saved["detectors"])
        self.clipper.load_state_dict(saved["clipper"])
        self.stall_clock.load_state_dict(saved.get("stall_clock") or {})  # none in a checkpoint written before it
        if self.evals is not None and saved.get("evals"):  # a checkpoint written without eval has none
            self.evals.load_state_dict(saved["evals"])
        same_world = saved["progress"].get("world_size") == world_size
        comm = saved.get("comm_hook") or []
        if self.comm_state is not None and same_world and comm and comm[rank]:
            load_powersgd_state(self.comm_state, comm[rank], device)
        rngs = saved.get("rng") or []
        if rngs:
            set_rng_state(rngs[rank] if same_world else rngs[0])
        ratio = saved["progress"].get("pending_update_ratio")
        return None if ratio is None else float(ratio)


def health_verdict(module: nn.Module, *, loss: float, loss_in_bounds: bool, anomalies: int,
                   summary: LossSummary, regression_tolerance: float, evals: EvalEvidence | None = None,
                   eval_regression_tolerance: float | None = None) -> tuple[bool, dict[str, Any]]:
    """(healthy, verdict): healthy when the weights are finite, the loss is within the loss detector's bounds and
    the smoothed loss has not regressed: at most ``regression_tolerance`` (plus one batch-noise deviation) above the
    best the lineage reached, so a rollback never lands on a checkpoint that had already drifted up. Anomalies
    since the previous checkpoint are recorded but do not decide: an unresolved one ends the attempt before any
    checkpoint, and a skipped step or a record-only finding leaves the state as healthy as it was.

    ``evals`` (the eval series, passed only when its newest eval measured these very weights) adds the held-out
    test: the eval loss must be finite and at most ``eval_regression_tolerance`` above the lineage's best eval loss
    (``workers/verdict.py``'s rule; None: not judged). Without it the verdict's keys and value are unchanged."""
    weights_finite = all_finite(list(module.parameters()))  # under FSDP: every rank's shards (one all-reduce)
    limit = None if summary.best is None else (1.0 + regression_tolerance) * summary.best + summary.noise_std
    regressed = limit is not None and summary.smoothed is not None and summary.smoothed > limit
    verdict = {
        "weights_finite": weights_finite,
        "anomalies_since_previous": anomalies,
        "loss_in_bounds": loss_in_bounds,
        "loss": finite_or_none(loss),
        "smoothed_loss": finite_or_none(summary.smoothed),
        "best_smoothed_loss": finite_or_none(summary.best),
        "regressed": regressed,
    }
    eval_regressed = False
    if evals is not None:
        limit = None if eval_regression_tolerance is None else eval_regression_limit(evals.best,
                                                                                     eval_regression_tolerance)
        eval_regressed = eval_regression_tolerance is not None and (
            not math.isfinite(evals.final) or (limit is not None and evals.final > limit))
        verdict |= {"eval_loss": finite_or_none(evals.final), "best_eval_loss": finite_or_none(evals.best),
                    "eval_regressed": eval_regressed}
    return weights_finite and loss_in_bounds and not regressed and not eval_regressed, verdict


@dataclass(frozen=True)
class _Write:
    """One checkpoint handed to the background writer: what its registration needs once it is written."""

    step: int
    location: Location
    uri: str
    meta: dict[str, Any]
    loss: float
    on_saved: Callable[[SavedCheckpoint], None]
    copy_s: float
    """The loop's time to copy the state to host memory (``HostStaging.copy``)."""
    stall_s: float
    """The loop's whole time in ``Checkpointer.save``: the gather, the state dict, waiting for the previous write,
    the copy."""
    shards: Path | None = None
    """Strategy fsdp: the staging directory of every rank's shards, moved into the checkpoint by the write."""


@dataclass(frozen=True)
class _Written:
    write: _Write
    sha256: str
    bytes: int
    write_s: float
    """The background thread's time: serialise, checksum, write, fsync, verify (and plain-process retention)."""


class Checkpointer:
    """Writes one attempt's checkpoints from every rank (see the module docstring for where they go).

    Rank 0 snapshots the state to host memory in ``save`` and writes it on its ``BackgroundWriter``; the
    checkpoint is registered (``on_saved``, the ``checkpoint`` event, the corrupt-checkpoint fault) on the training
    thread by ``poll`` (every step), by the next ``save`` or by ``drain`` (the attempt's end), once its write
    returned, i.e. once it is on storage and verified. Call ``close`` when the attempt is over.
    """

    def __init__(self, spec: AttemptSpec, ctx: WorkerContext, sink: EventSink | None,
                 faults: FaultInjector) -> None:
        self.spec = spec
        self.ctx = ctx
        self.sink = sink
        self.faults = faults
        self._writer: BackgroundWriter[_Written] | None = BackgroundWriter() if ctx.is_main else None
        self._staging = HostStaging()

    def save(self, step: int, state: TrainingState, *, healthy: bool, verdict: dict[str, Any], loss: float,
             pending_update_ratio: float | None, on_saved: Callable[[SavedCheckpoint], None]) -> None:
        """Checkpoint the state after ``step`` completed steps (a collective: every rank calls it).

        Returns once rank 0 holds a host-memory copy of the state (after the previous write, if still in flight,
        was registered); ``on_saved`` sees the checkpoint when it is registered.
        """
        started = time.perf_counter()
        ctx = self.ctx
        per_rank = gather_objects({**state.rank_part(), "node": state.node_of(ctx)}, ctx)
        shards = None  # strategy fsdp: every rank writes its shards now; rank 0's background write adopts them
        if fsdp_enabled(self.spec.recipe):
            shards = stage_shards(state.module, state.optimizer, ctx, staging_root(ctx, self.spec.checkpoint_dir))
        if self._writer is None:
            return
        self._register_pending()  # at most one write in flight: the staging buffers are free again
        name = f"step_{step:08d}"
        progress = {"step": step, "data_offset": self.spec.data_offset, "attempt": self.spec.attempt,
                    "world_size": ctx.world_size, "pending_update_ratio": pending_update_ratio}
        meta = {"step": step, "healthy": healthy, "verdict": verdict, "attempt": self.spec.attempt,
                "run_id": self.spec.run_id, "recipe": self.spec.recipe.name, "nodes": [r["node"] for r in per_rank]}
        parts = state.state_dict(per_rank, progress)
        if shards is not None:
            parts, meta["shards"] = without_sharded_parts(parts), shards_meta(ctx.world_size)
        check_state(parts, meta)
        copying = time.perf_counter()
        snapshot = self._staging.copy(parts)
        copied = time.perf_counter()
        if ctx.ray_train and ctx.checkpoint_uri_prefix:
            uri = f"{ctx.checkpoint_uri_prefix.rstrip('/')}/{name}"
            location = Location(uri, ctx.storage)
        else:
            location = Location(Path(self.spec.checkpoint_dir) / name)
            uri = str(location.local)
        write = _Write(step=step, location=location, uri=uri, meta=meta, loss=loss, on_saved=on_saved,
                       copy_s=copied - copying, stall_s=time.perf_counter() - started, shards=shards)
        self._writer.submit(lambda: self._write(write, snapshot))

    def poll(self) -> None:
        """Register the write in flight if it has finished (never waits)."""
        if self._writer is not None and self._writer.done():
            self._register_pending()

    def drain(self) -> None:
        """Wait for the write in flight and register it (a collective: every rank calls it, and every rank may
        read the attempt's checkpoints afterwards)."""
        self._register_pending()
        barrier(self.ctx)

    def close(self) -> None:
        """End the writer thread; a write still in flight finishes but is not registered."""
        if self._writer is not None:
            self._writer.close()

    def _write(self, write: _Write, snapshot: dict[str, Any]) -> _Written:
        """The background part: serialise, checksum, write (the manifest last), verify; retention in a plain
        process. Only what it returns is registered."""
        started = time.perf_counter()
        try:
            encoded = encode_checkpoint(snapshot, write.meta, None if write.shards is None else {SHARDS: write.shards})
            write_checkpoint(write.location, encoded)
        finally:
            if write.shards is not None:  # moved into the checkpoint (or the write failed): drop what is left
                shutil.rmtree(write.shards, ignore_errors=True)
        verify_checkpoint(write.location, expected_sha256=encoded.sha256)
        if not (self.ctx.ray_train and self.ctx.checkpoint_uri_prefix):
            apply_retention(self.spec.checkpoint_dir, self.spec.recipe.checkpoint.keep,
                            self.spec.recipe.checkpoint.keep_healthy)
        size = sum(len(b) for b in encoded.files.values()) + len(encoded.manifest)
        return _Written(write=write, sha256=encoded.sha256, bytes=size, write_s=time.perf_counter() - started)

    def _register_pending(self) -> None:
        """The finished write's registration, on the training thread: the attempt's result, the ``checkpoint``
        event (how the store learns of it), then the corrupt-checkpoint fault. A failed write raises here."""
        if self._writer is None or not self._writer.busy:
            return
        done = self._writer.collect()
        w = done.write
        healthy = bool(w.meta["healthy"])
        w.on_saved(SavedCheckpoint(step=w.step, path=w.uri, healthy=healthy, sha256=done.sha256))
        if self.sink is not None:
            verdict = w.meta["verdict"]
            self.sink.emit("checkpoint", {
                "step": w.step, "uri": w.uri, "sha256": done.sha256, "healthy": healthy, "verdict": verdict,
                "metrics": self._metrics(w.loss, verdict),
                "timing": {"stall_s": w.stall_s, "copy_s": w.copy_s, "write_s": done.write_s, "bytes": done.bytes},
            })
            self.sink.flush()
        self.faults.after_checkpoint(w.step, w.location)

    @staticmethod
    def _metrics(loss: float, verdict: Mapping[str, Any]) -> dict[str, Any]:
        """The checkpoint event's metrics: the loss, the smoothed loss and, when measured here, the eval loss."""
        out = {"loss": finite_or_none(loss), "smoothed_loss": verdict.get("smoothed_loss")}
        if "eval_loss" in verdict:
            out["eval_loss"] = verdict["eval_loss"]
        return out


@contextlib.contextmanager
def materialize(uri: str | None, storage: StorageOptions | None = None) -> Iterator[str | None]:
    """A local directory for a checkpoint path or URI (downloaded through Ray Train for remote storage)."""
    if uri is None:
        yield None
        return
    local = local_dir(uri)
    if local is not None:
        yield str(local)
        return
    import ray.train

    fs, path_in_fs = (storage or StorageOptions()).filesystem(uri)
    with ray.train.Checkpoint(path_in_fs, filesystem=fs).as_directory() as path:
        yield str(path)
