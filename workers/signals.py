"""The signals packet: what each rank contributes to a step's decision, gathered in one collective.

Each rank packs its numbers for the step into one small float tensor (``RankSignals.pack``); one all-gather hands
every rank's packet to every rank, the only host sync of an ordinary step; every rank unpacks the same rows and
``combine`` derives the same ``StepSignals`` from them, so every rank's detectors make the same decision at the
same step (otherwise the next collective would deadlock).

Layout of a packet, in order: the named scalars of ``RankSignals`` (``SCALARS``), then (on layer-stats steps only) one
pre-clip grad norm per block. Every rank packs the same number of blocks, so the rows have equal length.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic, TypeVar

import torch
from torch import Tensor

from workers.context import WorkerContext, gather_rows
from workers.detectors import StepSignals

T = TypeVar("T", Tensor, float)
"""A 0-dim device tensor before the gather, a host float after it."""


@dataclass(frozen=True)
class RankSignals(Generic[T]):
    """One rank's signals for one step, by name (``pack``: into the gathered tensor; ``unpack``: out of a row)."""

    loss: T
    """Mean loss over the rank's micro-batches (may be nan/inf)."""
    grad_norm: T
    """Global pre-clip grad norm of the rank's unscaled gradients."""
    loss_nonfinite: T
    """1.0 if the loss is nan/inf, else 0.0."""
    grads_nonfinite: T
    """1.0 if the grad norm is nan/inf (some gradient is), else 0.0."""
    stop: T
    """1.0 if this rank's sink was asked to stop the attempt."""
    loss_scale: T
    """The loss scale used this step (1.0 without loss scaling)."""
    clipped_norm: T
    """Global grad norm after clipping."""
    update_ratio: T
    """The last measured update ratio (of the previous step's update), NaN when none is pending."""
    block_norms: tuple[T, ...] = ()
    """Pre-clip grad norm per block, input→output, on layer-stats steps (empty otherwise)."""

    SCALARS: ClassVar[tuple[str, ...]] = (
        "loss", "grad_norm", "loss_nonfinite", "grads_nonfinite", "stop", "loss_scale", "clipped_norm", "update_ratio",
    )
    """The packet's leading entries, in order (the fields above, ``block_norms`` excepted)."""

    def pack(self: RankSignals[Tensor]) -> Tensor:
        """The packet as one 1-D tensor on the device."""
        return torch.stack([*(getattr(self, name) for name in self.SCALARS), *self.block_norms])

    @classmethod
    def unpack(cls, row: Sequence[float]) -> RankSignals[float]:
        """A packet back from one gathered row."""
        n = len(cls.SCALARS)
        scalars = dict(zip(cls.SCALARS, row[:n], strict=True))
        return RankSignals(**scalars, block_norms=tuple(row[n:]))


@dataclass(frozen=True)
class GatheredStep:
    """What every rank knows about a step after the gather."""

    signals: StepSignals
    """For the detectors: identical on every rank."""
    clipped_norm: float
    """Post-clip global grad norm, the largest over ranks."""
    stop_requested: bool
    """Some rank's sink asked to stop."""


def gather(packet: RankSignals[Tensor], ctx: WorkerContext) -> list[RankSignals[float]]:
    """Every rank's packet for this step, in rank order (one all-gather, one host sync)."""
    return [RankSignals.unpack(row) for row in gather_rows(packet.pack(), ctx)]


def combine(step: int, rows: Sequence[RankSignals[float]], *, fp16_dynamic: bool, layer_step: bool) -> GatheredStep:
    """The step's ``StepSignals`` from every rank's packet: mean loss; finite only if every rank is finite; the
    grad norm (and ``rank``) of the first non-finite rank, else of the largest norm; per-block and update-ratio
    maxima over ranks; the loss scale of rank 0 under dynamic fp16 scaling."""
    n_ranks = len(rows)
    loss = sum(r.loss for r in rows) / n_ranks
    loss_ok = all(r.loss_nonfinite == 0 for r in rows)
    grads_ok = all(r.grads_nonfinite == 0 for r in rows)
    bad = [i for i, r in enumerate(rows) if r.loss_nonfinite or r.grads_nonfinite]
    worst = bad[0] if bad else max(range(n_ranks), key=lambda i: rows[i].grad_norm)
    ratios = [r.update_ratio for r in rows if math.isfinite(r.update_ratio)]
    block_norms = None
    if layer_step and rows[0].block_norms:
        block_norms = [max(r.block_norms[j] for r in rows) for j in range(len(rows[0].block_norms))]
    signals = StepSignals(
        step=step,
        loss=loss,
        grad_norm=rows[worst].grad_norm,
        finite=loss_ok and grads_ok,
        loss_scale=rows[0].loss_scale if fp16_dynamic else None,
        overflow=fp16_dynamic and not grads_ok,
        layer_grad_norms=block_norms,
        update_ratio=max(ratios) if ratios else None,
        rank=worst,
    )
    return GatheredStep(
        signals=signals,
        clipped_norm=max(r.clipped_norm for r in rows),
        stop_requested=any(r.stop > 0 for r in rows),
    )
