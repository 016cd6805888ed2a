"""Injected faults from the recipe: the failures Ballast must survive, on demand, for tests and demos.

The injector only perturbs the numbers (loss, gradients, batch) or the process (SIGKILL, a hang, a corrupted
checkpoint); it never tells the detectors anything. Catching the effect from the numbers alone is the point.
A fault fires only in the attempt it names and, when it names a rank, only on that rank.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from contracts.recipe import (
    BatchScaleFault,
    CorruptCheckpointFault,
    GradScaleFault,
    HangFault,
    KillWorkerFault,
    NanLossFault,
)
from contracts.storage import Location
from workers.data.batch import Batch, has_float_inputs, scale_float_inputs
from workers.sharding import local


class InjectedCrash(RuntimeError):
    """Raised by the corrupt_checkpoint fault after it damaged the checkpoint: the attempt must crash."""


class FaultInjector:
    """The recipe's faults for one (attempt, rank); each hook is a no-op unless a fault fires there."""

    def __init__(self, faults: Sequence[Any], attempt: int, rank: int) -> None:
        self.attempt = attempt
        self.rank = rank
        self.faults = [f for f in faults if f.attempt == attempt and (f.rank is None or f.rank == rank)]
        self._corrupted: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _at(self, step: int, kind: type[Any]) -> list[Any]:
        return [f for f in self.faults if isinstance(f, kind) and f.step == step]

    def before_step(self, step: int) -> None:
        """kill_worker: die like a preempted or OOM-killed worker (no cleanup, no exception); hang: stop making
        progress without dying, like a rank stuck in a collective that never returns (its peers then block in
        the step's own collectives). Only the step-progress deadline ends it."""
        if self._at(step, KillWorkerFault):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._at(step, HangFault):
            while True:
                time.sleep(3600)

    def on_batch(self, step: int, batch: Batch) -> Batch:
        """batch_scale on the float inputs of a tuple or dict batch (targets and ``labels`` are left alone); a
        batch with integer inputs only (tokens) is scaled through the loss in ``on_loss`` instead."""
        for f in self._at(step, BatchScaleFault):
            if has_float_inputs(batch):
                batch = scale_float_inputs(batch, f.factor)
        return batch

    def on_loss(self, step: int, loss: torch.Tensor, batch: Batch | torch.Tensor | None = None) -> torch.Tensor:
        """nan_loss: the loss (and so every gradient) becomes NaN; batch_scale on a batch without float inputs (the
        batch, or just its inputs tensor) scales the loss."""
        for _ in self._at(step, NanLossFault):
            loss = loss * float("nan")
        if batch is not None:
            integer_only = (not batch.is_floating_point()) if isinstance(batch, torch.Tensor) \
                else not has_float_inputs(batch)
            if integer_only:
                for f in self._at(step, BatchScaleFault):
                    loss = loss * f.factor
        return loss

    def on_grads(self, step: int, params: Iterable[torch.nn.Parameter]) -> None:
        """grad_scale: multiply every gradient after backward (after DDP's all-reduce: only this rank; under FSDP
        this rank's shards)."""
        faults = self._at(step, GradScaleFault)
        if not faults:
            return
        grads = [local(p.grad) for p in params if p.grad is not None]
        for f in faults:
            if grads:
                torch._foreach_mul_(grads, f.factor)

    def after_checkpoint(self, step: int, path: Location | str | os.PathLike[str] | None) -> None:
        """corrupt_checkpoint: flip bytes in the checkpoint just written (the first at or after the fault's
        step), on disk or in the object store, then crash, so the next attempt has to notice the damage."""
        if path is None:
            return
        for i, f in enumerate(self.faults):
            if isinstance(f, CorruptCheckpointFault) and step >= f.step and i not in self._corrupted:
                self._corrupted.add(i)
                damaged = corrupt_checkpoint_dir(path if isinstance(path, Location) else Path(path))
                raise InjectedCrash(f"injected fault: corrupted checkpoint {damaged} at step {step}")


def corrupt_checkpoint_dir(path: Path | Location) -> Path | str:
    """Flip bytes in the middle of the largest state file of a checkpoint (not its manifest), on disk or in the
    object store; return the file's path or URI."""
    where = path if isinstance(path, Location) else Location(path)
    files = {name: size for name, size in where.files().items() if "manifest" not in name}
    if not files:
        raise FileNotFoundError(f"no state file in checkpoint {where}")
    name = max(files, key=lambda n: files[n])
    data = bytearray(where.read_bytes(name))
    if not data:
        data = bytearray(b"\xff")
    mid = len(data) // 2
    for i in range(mid, min(mid + 16, len(data))):
        data[i] ^= 0xFF
    where.write_bytes(name, bytes(data))
    return where.local / name if where.local is not None else f"{where.uri.rstrip('/')}/{name}"
