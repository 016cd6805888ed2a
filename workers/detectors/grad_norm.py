"""Gradient-norm spikes: an EMA z-score of the log global norm before clipping."""

from __future__ import annotations

import math
from typing import Any

from contracts.recipe import (
    GradNormSpikeDetector,
)
from workers.detectors.base import Detector, Ema, Emit, StepSignals, Streak, safe_exp


class GradNormSpike(Detector):
    name = "grad_norm_spike"
    cfg: GradNormSpikeDetector

    def __init__(self, cfg: GradNormSpikeDetector) -> None:
        super().__init__(cfg)
        self.ema = Ema(cfg.ema_alpha)
        self.run = Streak()
        self._pending: float | None = None

    def evaluate(self, s: StepSignals, emit: Emit) -> None:
        cfg, g = self.cfg, s.grad_norm
        self._pending = None
        if not math.isfinite(g) or g <= 0.0:
            return  # non-finite: the nonfinite detector's; zero: the vanishing detector's
        x = math.log(g)
        anomalous = False
        z = std = level = 0.0
        if self.ema.n >= max(cfg.warmup_steps, 2):
            std = max(self.ema.std, 1e-12)
            z = (x - self.ema.mean) / std
            level = safe_exp(self.ema.mean)
            anomalous = z > cfg.z_threshold and g > cfg.min_ratio * level
        self.run.update(anomalous, s.step)
        if anomalous:
            if self.run.fires(cfg.patience, cfg.action):
                threshold = max(safe_exp(self.ema.mean + cfg.z_threshold * std), cfg.min_ratio * level)
                emit(self, "grad_norm_spike", g, threshold, cfg.action, self.run.onset,
                     {"z": z, "ema_level": level, "ema_log_std": self.ema.std, "run_length": self.run.count})
        else:
            self._pending = x

    def commit(self, absorb: bool) -> None:
        if absorb and self._pending is not None:
            self.ema.update(self._pending)
        self._pending = None

    @property
    def level(self) -> float | None:
        """The EMA level exp(mean log norm): the median of a log-normal norm distribution."""
        return safe_exp(self.ema.mean) if self.ema.n else None

    def state(self) -> dict[str, Any]:
        return {"ema": self.ema.state(), "run": self.run.state()}

    def load(self, d: dict[str, Any]) -> None:
        self.ema.load(d["ema"])
        self.run.load(d["run"])
