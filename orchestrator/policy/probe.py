"""The LR probe's two pure rules (``recovery.lr_probe``): which LRs a retry probes, and how the probe's result
becomes the attempt's settings.

Why a probe: after an early blow-up the policy cuts the LR by a fixed factor, and the first cut LR that no longer
blows up is kept although a lower one often trains far better; nothing a run sees at one LR says so. The probe
compares: the retry first trains a few dozen steps from its rollback point at each candidate (the worker runs it,
``workers/lr_probe.py``) and keeps the best. What it costs (candidates × steps, a fifth of the run by default, and
never more than 100 steps a candidate) is why ``auto`` turns it on only for runs long enough to afford it
(``LrProbe.active``: 150 steps and more with the defaults).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from contracts.recipe import Recipe
from contracts.wire import ProbePlan
from orchestrator.policy.tightening import LR


def probe_plan(eff: Recipe, new_lr: float | None) -> ProbePlan | None:
    """The probe of a retry that moves the LR to ``new_lr`` (None: it does not move it): ``new_lr``, then each
    ``spacing`` times the previous, floored at ``min_lr`` (a candidate at the floor is the last). None when the probe
    is off for this run's length or there are fewer than two distinct candidates."""
    cfg, floor = eff.recovery.lr_probe, eff.recovery.min_lr
    if new_lr is None or not cfg.active(eff.training.max_steps):
        return None
    candidates = [new_lr]
    while len(candidates) < cfg.candidates and candidates[-1] > floor:
        candidates.append(max(candidates[-1] * cfg.spacing, floor))
    if len(candidates) < 2:
        return None
    return ProbePlan(candidates=tuple(candidates), steps=cfg.steps_for(eff.training.max_steps))


def apply_probe_result(
    overrides: Mapping[str, Any], plan: Mapping[str, Any], reason: str | None, result: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], str] | None:
    """An attempt's ``(overrides, plan, reason)`` once its worker reports the probe (an ``lr_probe`` event): the LR
    override becomes the chosen LR (the next retry tightens from it, and a crash restart resumes at it), the plan
    keeps the probe's result (``chosen``, ``steps_run``, ``candidates_run``) and the reason says what was chosen. None
    when there is nothing to change: the result is already recorded (a redelivered event), or it names no LR."""
    probe = dict(plan.get("lr_probe") or {})
    chosen = result.get("chosen")
    if probe.get("chosen") is not None or not isinstance(chosen, int | float) or isinstance(chosen, bool):
        return None
    probe.update(
        chosen=float(chosen),
        steps_run=int(result.get("steps_run") or 0),
        candidates_run=list(result.get("candidates") or []),
    )
    new_overrides = {path: list(change) for path, change in overrides.items()}
    if LR in new_overrides:  # the plan moved the LR (the only case it probes): [original, chosen]
        new_overrides[LR] = [new_overrides[LR][0], float(chosen)]
    text = str(result.get("reason") or f"lr probe chose {chosen}")
    return new_overrides, {**plan, "lr_probe": probe}, f"{reason}; {text}" if reason else text
