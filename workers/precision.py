"""Compute precision: the autocast context and the loss scaler the loop calls around forward and backward.

Master weights stay fp32; ``autocast`` only changes the compute dtype of the forward pass. Loss scaling exists
for fp16 only (bf16 has fp32's exponent range): ``dynamic`` wraps ``torch.amp.GradScaler`` with the recipe's
constants, ``static`` multiplies by a fixed scale, ``none`` does nothing.

The loop, not the scaler, decides whether the optimizer steps: under DDP every rank must make the same call, so
the overflow flag the scaler consumes in ``update`` is the *all-reduced* one the loop computed, not the rank's
own. That is why this wrapper never calls ``GradScaler.step``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from contracts.recipe import DType, LossScaling, Precision

_DTYPES = {DType.bf16: torch.bfloat16, DType.fp16: torch.float16}


def device_type_of(device: torch.device | str) -> str:
    return torch.device(device).type


@contextlib.contextmanager
def autocast(dtype: DType | str, device: torch.device | str) -> Iterator[None]:
    """Autocast to bf16/fp16 on CPU or CUDA; fp32 means no autocast at all (not autocast to fp32)."""
    dtype = DType(dtype)
    if dtype is DType.fp32:
        yield
        return
    with torch.autocast(device_type=device_type_of(device), dtype=_DTYPES[dtype]):
        yield


class LossScaler:
    """Loss scaling for one optimizer: scale the loss, unscale the grads, update the scale from a global flag.

    Usage per step: ``scaler.scale(loss).backward()`` (per micro-batch) → ``scaler.unscale_(optimizer)`` →
    the loop computes the all-reduced non-finite flag → ``scaler.update(found_inf)``. ``scale_tensor()`` is the
    scale used for this step as a 0-dim tensor (no host sync), so the loop can carry it in its signals tensor.
    """

    def __init__(self, cfg: Precision, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        if DType(cfg.dtype) is DType.fp16:
            self.mode = LossScaling(cfg.loss_scaling)
        else:
            self.mode = LossScaling.none
        self._gs: torch.amp.GradScaler | None = None
        self._static = torch.tensor(float(cfg.static_scale), dtype=torch.float32, device=self.device)
        self._one = torch.ones((), dtype=torch.float32, device=self.device)
        self._optimizer_id: int | None = None
        if self.mode is LossScaling.dynamic:
            self._gs = torch.amp.GradScaler(
                device_type_of(self.device),
                init_scale=cfg.init_scale,
                growth_factor=cfg.growth_factor,
                backoff_factor=cfg.backoff_factor,
                growth_interval=cfg.growth_interval,
                enabled=True,
            )

    @property
    def enabled(self) -> bool:
        return self.mode is not LossScaling.none

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        if self._gs is not None:
            return self._gs.scale(loss)
        if self.mode is LossScaling.static:
            return loss * self._static
        return loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the accumulated grads by the scale, in place (one fused op per device and dtype)."""
        if self._gs is not None:
            self._optimizer_id = id(optimizer)
            self._gs.unscale_(optimizer)
        elif self.mode is LossScaling.static:
            grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
            if grads:
                torch._foreach_div_(grads, self._static)

    def scale_tensor(self) -> torch.Tensor:
        """The scale used for the current step (0-dim fp32 tensor; 1 when scaling is off). No host sync."""
        if self._gs is not None:
            scale = self._gs._get_scale_async()
            if scale is None:  # lazily created on the first scale(); before that it is the initial value
                return torch.tensor(self._gs._init_scale, dtype=torch.float32, device=self.device)
            return scale
        if self.mode is LossScaling.static:
            return self._static
        return self._one

    def update(self, found_inf: torch.Tensor | bool) -> None:
        """End of step: back off on overflow, grow after ``growth_interval`` clean steps (dynamic only).

        ``found_inf`` is the flag all ranks agreed on; it replaces the rank-local flag that ``unscale_``
        recorded, so every rank's scale stays identical (different scales would corrupt the averaged grads).
        """
        if self._gs is None:
            return
        flag = torch.as_tensor(found_inf, dtype=torch.float32, device=self.device).reshape(())
        flag = (flag != 0).to(torch.float32)
        states = self._gs._per_optimizer_states
        if self._optimizer_id is None or self._optimizer_id not in states:
            raise RuntimeError("LossScaler.update() called without unscale_() in this step")
        recorded = states[self._optimizer_id]["found_inf_per_device"]
        if not recorded:  # no grads at all this step: record the agreed flag on the scale's device
            recorded[self.device] = flag.clone()
        for t in recorded.values():
            t.copy_(flag)
        self._gs.update()
        self._optimizer_id = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode.value,
            "static_scale": float(self._static),
            "grad_scaler": self._gs.state_dict() if self._gs is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the dynamic scale and growth tracker; a mode change (e.g. fp16 → bf16 retry) starts fresh."""
        if state.get("mode") != self.mode.value:
            return
        if self._gs is not None and state.get("grad_scaler"):
            self._gs.load_state_dict(state["grad_scaler"])
