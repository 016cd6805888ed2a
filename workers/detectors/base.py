"""What every detector shares: the step signals, findings and decisions, streaming statistics, patience."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel

from contracts.recipe import (
    Action,
)
from contracts.wire import ANOMALY_KINDS, finite_or_none

STATE_VERSION = 1
LOSS_STD_FLOOR = 1e-3
"""Loss z-score: the std used is at least this fraction of the EMA mean, so a perfectly flat loss does not make
every wiggle infinitely significant."""
OSCILLATION_FLOOR = 1e-4
"""Oscillation: the long-run level used is at least (this x |loss|)^2, for the same reason."""
MIN_DEPTH_POINTS = 3
"""Layers (with a positive, finite grad norm) needed to fit a depth slope."""
INITIAL_LOSS_STEPS = 5
"""Loss detector: the initial loss is the mean of the absorbed losses among this many first finite ones."""
MIN_PROGRESS = 0.1
"""Loss detector: the collapse rule applies once the best smoothed loss is this fraction below the initial loss
(and ``NOISE_MARGIN`` noise deviations), so that a run that has barely started learning cannot collapse."""
NOISE_MARGIN = 4.0
"""Loss detector: the initial-ratio rule's rise above the initial loss, and the collapse rule's progress below it,
must also be at least this many batch-noise standard deviations, so that a noisy per-batch loss (MSE on small
batches) is not taken for divergence."""

_STRENGTH = {Action.record: 0, Action.skip_step: 1, Action.rollback: 2}


def stronger(a: Action, b: Action) -> Action:
    return a if _STRENGTH[Action(a)] >= _STRENGTH[Action(b)] else b


@dataclass
class StepSignals:
    """One step's signals, already all-reduced across ranks by the loop (loss: mean, finite: all, norms: the
    unscaled global norm, which DDP makes identical on every rank)."""

    step: int
    loss: float
    """May be nan/inf."""
    grad_norm: float
    """Global pre-clip gradient norm after unscaling; may be nan/inf."""
    finite: bool
    """Loss and all gradients finite on every rank."""
    loss_scale: float | None = None
    """fp16 dynamic loss scaling only: the scale used this step."""
    overflow: bool = False
    """fp16: the GradScaler found inf/nan gradients (the scaler drops that update itself)."""
    layer_grad_norms: list[float] | None = None
    """Per-block grad norms in input→output order, only on layer-stats steps (0.0 for frozen blocks)."""
    update_ratio: float | None = None
    """||Δw||/||w|| of the most recent applied update, only on layer-stats steps. It is measured after
    ``optimizer.step()``, so the loop may pass it with the following step's signals."""
    rank: int = 0
    """Rank the worst signal came from (for the record)."""


@dataclass
class Finding:
    """One anomaly: what fired, on which numbers, and what the loop must do about it."""

    step: int
    kind: str
    detector: str
    value: float | None
    threshold: float | None
    action: Action
    details: dict[str, Any] = field(default_factory=dict)
    rank: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ANOMALY_KINDS:
            raise ValueError(f"anomaly kind {self.kind!r} is not in contracts.wire.ANOMALY_KINDS")

    def to_event(self) -> dict[str, Any]:
        """The ``anomaly`` event payload (see ``contracts/wire.py``); values are finite floats or None."""
        return {
            "step": self.step,
            "rank": self.rank,
            "kind": self.kind,
            "detector": self.detector,
            "value": finite_or_none(self.value),
            "threshold": finite_or_none(self.threshold),
            "action": str(Action(self.action)),
            "details": self.details,
        }


@dataclass
class Decision:
    findings: list[Finding]
    action: Action
    """The strongest action among the findings (rollback > skip_step > record); record when nothing fired."""
    onset_step: int | None
    """Earliest onset (first step of the anomalous run) among the findings whose action is ``action``; None
    when nothing fired."""
    clip_to: float | None = None
    """Set on the second and later steps of a run of consecutive finite ``skip_step`` decisions (a spike that
    recurred at the weights the first skip left unchanged): apply the update after all, its gradient's global norm
    clipped to this (the healthy level)."""

    @property
    def skip(self) -> bool:
        """The update is discarded (a recurring spike's clipped update is applied instead: ``clip_to``)."""
        return self.action is Action.skip_step and self.clip_to is None

    @property
    def rollback(self) -> bool:
        return self.action is Action.rollback


def json_num(x: float) -> float | str:
    """A JSON-safe number: finite floats as they are, nan/inf as strings."""
    return float(x) if math.isfinite(x) else str(x)


def safe_exp(x: float) -> float:
    return math.exp(min(x, 700.0))


def depth_slope(layer_norms: Sequence[float]) -> float | None:
    """Least-squares slope of ln(grad norm) per layer, measured from the output layer back toward the input.

    Negative means the norms shrink toward the input (vanishing with depth); ``-0.5`` is each layer about 0.6x
    the one above it. Non-positive or non-finite entries (frozen blocks) are left out of the fit, keeping the
    other layers' positions; None with fewer than ``MIN_DEPTH_POINTS`` usable layers.
    """
    pts = [(float(d), math.log(v)) for d, v in enumerate(reversed(layer_norms)) if math.isfinite(v) and v > 0.0]
    if len(pts) < MIN_DEPTH_POINTS:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    sxy = sum((x - mx) * (y - my) for x, y in pts)
    return sxy / sxx


def diagnose_depth(layer_norms: Sequence[float], threshold: float) -> str | None:
    """``"vanishing with depth"`` when ``depth_slope`` is below ``threshold`` (for the ``layer_stats`` event)."""
    slope = depth_slope(layer_norms)
    return "vanishing with depth" if slope is not None and slope < threshold else None


class Ema:
    """Exponentially weighted mean and variance. The coefficient starts at 1/(n+1) (a plain running mean and
    population variance) and settles at ``alpha``, so the first estimates are not biased towards zero."""

    def __init__(self, alpha: float) -> None:
        self.alpha = alpha
        self.mean = 0.0
        self.var = 0.0
        self.n = 0

    def update(self, x: float) -> None:
        a = max(self.alpha, 1.0 / (self.n + 1))
        delta = x - self.mean
        self.mean += a * delta
        self.var = (1.0 - a) * (self.var + a * delta * delta)
        self.n += 1

    @property
    def std(self) -> float:
        return math.sqrt(self.var)

    def state(self) -> dict[str, Any]:
        return {"mean": self.mean, "var": self.var, "n": self.n}

    def load(self, d: dict[str, Any]) -> None:
        self.mean, self.var, self.n = float(d["mean"]), float(d["var"]), int(d["n"])
        if not (math.isfinite(self.mean) and math.isfinite(self.var) and self.var >= 0 and self.n >= 0):
            raise ValueError(f"bad EMA state {d}")


class Streak:
    """Consecutive anomalous observations and where the run began."""

    def __init__(self) -> None:
        self.count = 0
        self.onset: int | None = None

    def update(self, anomalous: bool, step: int) -> None:
        if anomalous:
            if self.count == 0:
                self.onset = step
            self.count += 1
        else:
            self.count, self.onset = 0, None

    def fires(self, patience: int, action: Action) -> bool:
        return self.count == patience or (self.count > patience and Action(action) is Action.skip_step)

    def state(self) -> dict[str, Any]:
        return {"count": self.count, "onset": self.onset}

    def load(self, d: dict[str, Any]) -> None:
        self.count = int(d["count"])
        self.onset = None if d["onset"] is None else int(d["onset"])


Emit = Callable[..., None]


class Detector:
    """Base: ``evaluate`` looks at a step and emits findings; ``commit`` absorbs that step into the running
    statistics once the suite knows the step was not skipped."""

    name = ""

    def __init__(self, cfg: BaseModel) -> None:
        self.cfg = cfg

    @property
    def enabled(self) -> bool:
        return bool(getattr(self.cfg, "enabled", True))

    @property
    def config(self) -> dict[str, Any]:
        return self.cfg.model_dump(mode="json")

    def evaluate(self, s: StepSignals, emit: Emit) -> None:
        raise NotImplementedError

    def commit(self, absorb: bool) -> None:
        return None

    def state(self) -> dict[str, Any]:
        raise NotImplementedError

    def load(self, d: dict[str, Any]) -> None:
        raise NotImplementedError
