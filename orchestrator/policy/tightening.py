"""The knobs a numeric retry turns, each a pure rule: the LR, the clip threshold, the warmup, and which goes first.

``orchestrator/policy/recovery.py`` decides *whether* and *from where* to retry; this module says *what changes*:
each function takes the effective recipe and returns the change (a dotted recipe path and its new value) with the
words for the reason, or no change with the reason why not (a knob at its floor).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from contracts.recipe import ClipMethod, Recipe, TightenOrder

MIN_AGC_LAMBDA = 1e-3
"""Floor for the adaptive-clipping ratio (``clipping.agc_lambda``) when tightening it."""

LR = "optimizer.lr"
METHOD = "clipping.method"
MAX_NORM = "clipping.max_norm"
AGC = "clipping.agc_lambda"
DTYPE = "precision.dtype"
WARMUP = "schedule.warmup_steps"
WARMUP_FRACTION = "schedule.warmup_fraction"

LOSS_KINDS = frozenset({"divergence", "loss_spike", "degraded", "eval_degraded", "never_learned", "stalled",
                        "collapsed", "oscillation", "above_bar", "nonfinite", "loss_scale_collapse"})
"""Ends whose evidence is the loss (or a non-finite value): the step size is too large, so the LR goes first."""
GRADIENT_KINDS = frozenset({"grad_norm_spike", "skip_escalation"})
"""Ends whose evidence is the gradient alone: a transient spike, so the clip threshold goes first."""
HOPELESS: dict[str, str] = {
    "vanishing": "vanishing gradients cannot be fixed by tightening the LR or the clip threshold (change the "
                 "activation, initialisation, normalisation or residuals)",
    "overfitting": "overfitting is not fixed by tightening the LR or the clip threshold (stop earlier, regularise "
                   "or add data)",
}
HOPELESS["vanishing_gradients"] = HOPELESS["vanishing"]
HOPELESS_KINDS = frozenset(HOPELESS)
"""Ends that no tightening of LR or clip can fix: the run fails with the diagnosis (``HOPELESS``: why)."""
NEVER_LEARNED = "never_learned"
NO_PROGRESS_KINDS = frozenset({NEVER_LEARNED, "stalled", "collapsed"})
"""Ends after which halving the LR is a guess that rarely suffices: it moves by the factor squared (a run that
stopped learning at its LR, rather than one that spiked, was not near the edge of stability but well past it). A
run that never learned may instead have had too low an LR: its probe also tries LRs above (``probe.upward_lrs``)."""
EARLY_FRACTION = 0.1
"""A divergence within this fraction of max_steps (and 10 steps) is early: without a warmup, one is added."""


@dataclass(frozen=True)
class Change:
    path: str
    new: Any


@dataclass(frozen=True)
class Knob:
    changes: tuple[Change, ...]
    text: str
    """What changed (for the reason) or, when ``changes`` is empty, why it could not."""


def tighten_lr(eff: Recipe, *, strong: bool = False) -> Knob:
    rec, lr = eff.recovery, eff.optimizer.lr
    if lr <= rec.min_lr:
        return Knob((), f"lr at floor {num(rec.min_lr)}")
    new = max(lr * (rec.lr_factor ** 2 if strong else rec.lr_factor), rec.min_lr)
    return Knob((Change(LR, new),), f"lr {num(lr)}→{num(new)}")


def tighten_clip(eff: Recipe, median: float | None) -> Knob:
    rec, clip = eff.recovery, eff.clipping
    method = clip.method
    target: float | None = None
    if rec.clip_to_median_multiple is not None and median is not None and method is not ClipMethod.per_layer:
        target = rec.clip_to_median_multiple * median
    note = f" ({num(rec.clip_to_median_multiple or 0.0)}×median grad norm {num(median or 0.0)})"
    if method is ClipMethod.none:
        new = max(target if target is not None else clip.max_norm, rec.min_clip)
        changes = [Change(METHOD, ClipMethod.global_norm.value)]
        if new != clip.max_norm:
            changes.append(Change(MAX_NORM, new))
        return Knob(tuple(changes), f"clipping none→global_norm at {num(new)}{note if target == new else ''}")
    if method is ClipMethod.adaptive:
        lam = clip.agc_lambda
        new = max(lam * rec.clip_factor, MIN_AGC_LAMBDA)
        if new >= lam:
            return Knob((), f"agc_lambda at floor {num(MIN_AGC_LAMBDA)}")
        return Knob((Change(AGC, new),), f"agc_lambda {num(lam)}→{num(new)}")
    cur = clip.max_norm
    if target is not None and target < cur:
        new, why = max(target, rec.min_clip), note
    else:
        new, why = max(cur * rec.clip_factor, rec.min_clip), ""
    if new >= cur:
        return Knob((), f"clip at floor {num(rec.min_clip)}")
    return Knob((Change(MAX_NORM, new),), f"clip {num(cur)}→{num(new)}{why if new == target else ''}")


def tighten_order_for(eff: Recipe, kind: str | None) -> TightenOrder:
    """Which knob goes first. An explicit ``tighten_order`` is obeyed; ``auto`` reads the evidence: a loss
    divergence (or a non-finite value) lowers the LR whatever the optimizer, a gradient spike with a healthy loss
    tightens the clip; anything else falls back to the optimizer family (LR for Adam, clip for SGD)."""
    order = eff.recovery.tighten_order
    if order is not TightenOrder.auto:
        return order
    if kind in LOSS_KINDS:
        return TightenOrder.lr_first
    if kind in GRADIENT_KINDS:
        return TightenOrder.clip_first
    return TightenOrder.lr_first if eff.optimizer.is_adam_family else TightenOrder.clip_first


def warmup_change(eff: Recipe, onset: int) -> Knob:
    """A divergence early in a run without warmup adds one; one during or right after the warmup lengthens it
    (the peak LR is lowered by the LR knob). Otherwise the schedule is left alone."""
    max_steps = eff.training.max_steps
    warmup = eff.schedule.resolved_warmup_steps(max_steps)
    early = max(10, int(EARLY_FRACTION * max_steps))
    if warmup == 0 and onset <= early:
        new = min(max(10, int(EARLY_FRACTION * max_steps)), max_steps // 2)
        text = f"added a {new}-step warmup (diverged at step {onset} with none)"
    elif 0 < warmup and onset <= warmup + max(10, warmup // 2):
        new = min(2 * warmup, max_steps // 2)
        text = f"warmup {warmup}→{new} steps (diverged at step {onset}, during or right after the warmup)"
    else:
        return Knob((), "")
    if new <= warmup:
        return Knob((), "")
    changes = [Change(WARMUP, new)]
    if eff.schedule.warmup_fraction is not None:
        changes.append(Change(WARMUP_FRACTION, None))
    return Knob(tuple(changes), text)



def num(x: float) -> str:
    """Short, readable number: 0.003, 0.0015, 1e-06, 1.0, 9.3."""
    s = f"{x:.4g}"
    if not any(c in s for c in ".en"):  # 'e', 'nan', 'inf'
        s += ".0"
    return s
