"""Oscillation: short-term loss variance far above its long-run level."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence
from typing import Any

from contracts.recipe import (
    OscillationDetector,
)
from workers.detectors.base import OSCILLATION_FLOOR, Detector, Ema, Emit, StepSignals, Streak


class Oscillation(Detector):
    """Short-term loss variance far above its long-run level.

    The short-term variance is a robust one, of the loss's step-to-step changes over the last ``window`` steps:
    ``(1.4826 * median |Δloss|)^2``. Differencing removes the downward trend (a fast-falling loss is not noise),
    and the median keeps one bad batch from looking like oscillation; a sustained alternation or noise burst moves
    it. The long-run level is an EMA (``ema_alpha``) of that same statistic. Because a window fills gradually,
    a burst raises its variance over ``window`` steps; so that the level does not chase that ramp, it absorbs
    only windows below ``sqrt(variance_ratio)`` times the level (the geometric midpoint between normal and
    anomalous).
    """

    name = "oscillation"
    cfg: OscillationDetector

    def __init__(self, cfg: OscillationDetector) -> None:
        super().__init__(cfg)
        self.n = 0
        self.diffs: deque[float] = deque(maxlen=cfg.window)
        self.last_loss: float | None = None
        self.level = Ema(cfg.ema_alpha)
        self.run = Streak()
        self._pending: tuple[float, float | None] | None = None  # (loss, window variance to absorb)

    @staticmethod
    def _robust_var(diffs: Sequence[float]) -> float:
        return (1.4826 * statistics.median(abs(d) for d in diffs)) ** 2

    def evaluate(self, s: StepSignals, emit: Emit) -> None:
        cfg, loss = self.cfg, s.loss
        self._pending = None
        if not math.isfinite(loss):
            return
        wvar: float | None = None
        elevated = False
        if self.last_loss is not None and len(self.diffs) >= cfg.window - 1:
            window = list(self.diffs)[-(cfg.window - 1) :] + [loss - self.last_loss]
            wvar = self._robust_var(window)
            if self.level.n >= 1 and self.n >= cfg.warmup_steps:
                level = max(self.level.mean, (OSCILLATION_FLOOR * abs(loss)) ** 2)
                elevated = wvar > math.sqrt(cfg.variance_ratio) * level
                anomalous = wvar > cfg.variance_ratio * level
                self.run.update(anomalous, s.step)
                if anomalous and self.run.fires(cfg.patience, cfg.action):
                    emit(self, "oscillation", wvar, cfg.variance_ratio * level, cfg.action, self.run.onset,
                         {"window_variance": wvar, "long_run_variance": self.level.mean, "window": cfg.window,
                          "run_length": self.run.count})
        self._pending = (loss, None if elevated else wvar)

    def commit(self, absorb: bool) -> None:
        if absorb and self._pending is not None:
            loss, wvar = self._pending
            if self.last_loss is not None:
                self.diffs.append(loss - self.last_loss)
            self.last_loss = loss
            self.n += 1
            if wvar is not None:
                self.level.update(wvar)
        self._pending = None

    def state(self) -> dict[str, Any]:
        return {"n": self.n, "diffs": list(self.diffs), "last_loss": self.last_loss, "level": self.level.state(),
                "run": self.run.state()}

    def load(self, d: dict[str, Any]) -> None:
        self.n = int(d["n"])
        self.diffs = deque((float(x) for x in d["diffs"]), maxlen=self.cfg.window)
        self.last_loss = None if d["last_loss"] is None else float(d["last_loss"])
        self.level.load(d["level"])
        self.run.load(d["run"])
