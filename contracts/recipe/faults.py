"""Injected faults, for tests and demos: each fires once, at a step of one attempt."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, StrictFloat, StrictInt

from contracts.recipe.base import Section


class _Fault(Section):
    step: StrictInt = Field(ge=0)
    """Step at which the fault fires."""
    attempt: StrictInt = Field(default=1, ge=1)
    """The only attempt in which the fault fires."""
    rank: StrictInt | None = Field(default=None, ge=0)
    """Rank that fires the fault (None: every rank)."""


class NanLossFault(_Fault):
    """Replace the loss with NaN."""

    type: Literal["nan_loss"] = "nan_loss"


class GradScaleFault(_Fault):
    """Multiply every gradient by factor after backward."""

    type: Literal["grad_scale"] = "grad_scale"
    factor: StrictFloat = Field(default=1e4, gt=0.0)
    """Gradient multiplier."""


class BatchScaleFault(_Fault):
    """Multiply the float inputs of one batch by factor (every float tensor of a dict batch but ``labels``); a batch
    with integer inputs only (tokens) has its loss multiplied instead."""

    type: Literal["batch_scale"] = "batch_scale"
    factor: StrictFloat = Field(default=1e3, gt=0.0)
    """Batch multiplier."""


class KillWorkerFault(_Fault):
    """SIGKILL the worker process."""

    type: Literal["kill_worker"] = "kill_worker"


class HangFault(_Fault):
    """Stop making progress without dying: the rank sleeps forever before the step (a stuck collective, a dead
    NIC); its peers then wait in the next collective. Only the step-progress deadline notices."""

    type: Literal["hang"] = "hang"


class CorruptCheckpointFault(_Fault):
    """Corrupt the newest checkpoint on disk (after it was written), then crash."""

    type: Literal["corrupt_checkpoint"] = "corrupt_checkpoint"


Fault = Annotated[
    NanLossFault | GradScaleFault | BatchScaleFault | KillWorkerFault | HangFault | CorruptCheckpointFault,
    Field(discriminator="type"),
]
