"""Batches as the engine sees them: ``(inputs, targets)`` tuples or dicts of tensors (keyword arguments).

Every move to the device and every injected perturbation of a batch goes through these helpers, so tuple and dict
batches are handled the same way everywhere.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

Batch = tuple[Any, ...] | dict[str, Any]
"""``(inputs, targets)`` or ``{name: tensor}`` (a dict batch is passed to the model as ``model(**batch)``)."""

TARGET_KEYS = ("labels",)
"""Dict-batch keys that hold targets (never scaled as inputs)."""


def _map(value: Any, fn: Any) -> Any:
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, Mapping):
        return {k: _map(v, fn) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_map(v, fn) for v in value)
    return value


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Every tensor of ``batch`` (nested in tuples, lists and dicts) on ``device``; other values unchanged."""
    out: Batch = _map(batch, lambda t: t.to(device, non_blocking=True))
    return out


def input_tensors(batch: Batch) -> list[Tensor]:
    """The tensors that are model inputs: ``batch[0]`` of a tuple, every non-target value of a dict."""
    if isinstance(batch, Mapping):
        return [v for k, v in batch.items() if k not in TARGET_KEYS and isinstance(v, Tensor)]
    first = batch[0] if len(batch) else None
    return [first] if isinstance(first, Tensor) else []


def has_float_inputs(batch: Batch) -> bool:
    """Whether any input tensor is floating point (a batch fault can then scale the inputs themselves)."""
    return any(t.is_floating_point() for t in input_tensors(batch))


def scale_float_inputs(batch: Batch, factor: float) -> Batch:
    """``batch`` with every floating-point input tensor multiplied by ``factor`` (integer inputs and targets kept)."""

    def scale(t: Any) -> Any:
        return t * factor if isinstance(t, Tensor) and t.is_floating_point() else t

    if isinstance(batch, Mapping):
        return {k: v if k in TARGET_KEYS else scale(v) for k, v in batch.items()}
    return (scale(batch[0]), *batch[1:])


def leading_size(batch: Batch) -> int | None:
    """The batch dimension of the first input tensor (None when there is none)."""
    inputs = input_tensors(batch)
    return int(inputs[0].shape[0]) if inputs and inputs[0].ndim > 0 else None
