"""Vanishing gradients: a global norm below a floor, or a per-layer profile that decays with depth."""

from __future__ import annotations

import math
from typing import Any

from contracts.recipe import (
    VanishingDetector,
)
from workers.detectors.base import Detector, Emit, StepSignals, Streak, depth_slope, json_num


class Vanishing(Detector):
    """Global norm below ``min_grad_norm`` for ``patience`` steps, or (on layer-stats steps) a depth profile whose
    ``depth_slope`` is below ``depth_slope_threshold``; both are kind ``vanishing_gradients``, and
    ``details.diagnosis`` is ``"vanishing with depth"`` when the latest profile shows it."""

    name = "vanishing"
    cfg: VanishingDetector

    def __init__(self, cfg: VanishingDetector) -> None:
        super().__init__(cfg)
        self.n = 0
        self.run = Streak()
        self.profile_run = Streak()
        self.last_slope: float | None = None

    def _diagnosis(self) -> str | None:
        slope = self.last_slope
        return "vanishing with depth" if slope is not None and slope < self.cfg.depth_slope_threshold else None

    def evaluate(self, s: StepSignals, emit: Emit) -> None:
        cfg = self.cfg
        if s.layer_grad_norms is not None:
            self.last_slope = depth_slope(s.layer_grad_norms)
            bad = self.n >= cfg.warmup_steps and self._diagnosis() is not None
            self.profile_run.update(bad, s.step)
            if bad and self.profile_run.fires(1, cfg.action):
                emit(self, "vanishing_gradients", self.last_slope, cfg.depth_slope_threshold, cfg.action, s.step,
                     {"diagnosis": "vanishing with depth", "source": "depth_profile",
                      "layer_grad_norms": [json_num(v) for v in s.layer_grad_norms]})
        if not math.isfinite(s.grad_norm):
            return
        self.n += 1
        low = self.n > cfg.warmup_steps and s.grad_norm < cfg.min_grad_norm
        self.run.update(low, s.step)
        if low and self.run.fires(cfg.patience, cfg.action):
            emit(self, "vanishing_gradients", s.grad_norm, cfg.min_grad_norm, cfg.action, self.run.onset,
                 {"diagnosis": self._diagnosis(), "source": "global_norm", "depth_slope": self.last_slope,
                  "run_length": self.run.count})

    def state(self) -> dict[str, Any]:
        return {"n": self.n, "run": self.run.state(), "profile_run": self.profile_run.state(),
                "last_slope": self.last_slope}

    def load(self, d: dict[str, Any]) -> None:
        self.n = int(d["n"])
        self.run.load(d["run"])
        self.profile_run.load(d["profile_run"])
        self.last_slope = None if d["last_slope"] is None else float(d["last_slope"])
