"""Stagnation: the update-to-weight ratio below a floor (training stopped moving)."""

from __future__ import annotations

import math
from typing import Any

from contracts.recipe import (
    StagnationDetector,
)
from workers.detectors.base import Detector, Emit, StepSignals, Streak


class Stagnation(Detector):
    name = "stagnation"
    cfg: StagnationDetector

    def __init__(self, cfg: StagnationDetector) -> None:
        super().__init__(cfg)
        self.n = 0
        self.run = Streak()

    def evaluate(self, s: StepSignals, emit: Emit) -> None:
        cfg = self.cfg
        self.n += 1
        r = s.update_ratio
        if r is None or not math.isfinite(r):
            return
        low = self.n > cfg.warmup_steps and r < cfg.min_update_ratio
        self.run.update(low, s.step)
        if low and self.run.fires(cfg.patience, cfg.action):
            emit(self, "stagnation", r, cfg.min_update_ratio, cfg.action, self.run.onset,
                 {"measurements": self.run.count})

    def state(self) -> dict[str, Any]:
        return {"n": self.n, "run": self.run.state()}

    def load(self, d: dict[str, Any]) -> None:
        self.n = int(d["n"])
        self.run.load(d["run"])
