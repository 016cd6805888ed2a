"""Non-finite loss or gradients (always at least a skip), and fp16 loss-scale collapse."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from contracts.recipe import (
    Action,
    NonFiniteDetector,
)
from workers.detectors.base import Detector, Emit, StepSignals, Streak, json_num, stronger


class NonFinite(Detector):
    name = "nonfinite"
    cfg: NonFiniteDetector

    def __init__(self, cfg: NonFiniteDetector, fp16: bool) -> None:
        super().__init__(cfg)
        self.fp16 = fp16
        self.overflow_steps: deque[int] = deque()
        self.collapse = Streak()

    def evaluate(self, s: StepSignals, emit: Emit) -> None:
        cfg = self.cfg
        loss_ok = math.isfinite(s.loss)
        grads_ok = s.finite and math.isfinite(s.grad_norm)
        normal_overflow = self.fp16 and s.overflow and loss_ok
        if not normal_overflow and not (loss_ok and grads_ok):
            action = stronger(cfg.action, Action.skip_step) if cfg.enabled else Action.skip_step
            emit(
                self, "nonfinite", None, None, action, s.step,
                {"loss": json_num(s.loss), "grad_norm": json_num(s.grad_norm), "finite": s.finite,
                 "configured_action": str(Action(cfg.action)), "enabled": cfg.enabled},
            )
        if not (self.fp16 and cfg.enabled):
            return
        if s.overflow:
            self.overflow_steps.append(s.step)
        while self.overflow_steps and self.overflow_steps[0] <= s.step - cfg.overflow_window:
            self.overflow_steps.popleft()
        fraction = len(self.overflow_steps) / cfg.overflow_window
        scale_low = s.loss_scale is not None and math.isfinite(s.loss_scale) and s.loss_scale < cfg.min_loss_scale
        too_many = fraction > cfg.max_overflow_fraction
        self.collapse.update(scale_low or too_many, s.step)
        if (scale_low or too_many) and self.collapse.fires(1, cfg.action):
            onset = self.overflow_steps[0] if too_many and not scale_low else self.collapse.onset
            emit(
                self, "loss_scale_collapse",
                s.loss_scale if scale_low else fraction,
                cfg.min_loss_scale if scale_low else cfg.max_overflow_fraction,
                cfg.action, onset,
                {"loss_scale": s.loss_scale, "overflow_fraction": fraction, "overflow_window": cfg.overflow_window,
                 "reason": "loss scale below min_loss_scale" if scale_low else "too many overflow steps"},
            )

    def state(self) -> dict[str, Any]:
        return {"overflow_steps": list(self.overflow_steps), "collapse": self.collapse.state()}

    def load(self, d: dict[str, Any]) -> None:
        self.overflow_steps = deque(int(x) for x in d["overflow_steps"])
        self.collapse.load(d["collapse"])
