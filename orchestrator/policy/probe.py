"""The LR probe's two pure rules (``recovery.lr_probe``): which LRs a retry probes, and how the probe's result
becomes the attempt's settings.

Why a probe: after an early blow-up the policy cuts the LR by a fixed factor, and the first cut LR that no longer
blows up is kept although a lower one often trains far better; nothing a run sees at one LR says so. The probe
compares: the retry first trains a few dozen steps from its rollback point at each candidate (the worker runs it,
``workers/lr_probe.py``) and keeps the best; a clean best also shows that the retry's LR ramps (the re-warm, an
added warmup) are not needed, and the attempt trains without them. What it costs (candidates × steps, a fifth of
the run by default, and never more than 100 steps a candidate) is why ``auto`` turns it on only for runs long
enough to afford it (``LrProbe.active``: 150 steps and more with the defaults).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from contracts.overrides import get_path
from contracts.recipe import MAX_LR, Recipe, recipe_to_dict
from contracts.wire import ProbePlan
from orchestrator.policy.tightening import LR, NEVER_LEARNED, WARMUP, WARMUP_FRACTION, Change

REPLAYABLE_KINDS = frozenset({"nonfinite", "loss_spike", "grad_norm_spike"})
"""Ends that one step's numbers made, as a transient makes them: a non-finite value, a loss or gradient far outside
its recent spread. Not ``divergence`` (the loss's level rose above the untrained model's, the initial loss or a
multiple of its best: a trend, which a replay of the same settings reproduces, so replaying it only costs steps;
every early retry of the benchmark's development half is one, and the replay took ``dev-lsq-sgd-beyond-limit``
from 1.25x to 1.31x of its steps), nor the verdicts judged over a whole run, such as a stall."""


def probe_plan(
    eff: Recipe, changes: Sequence[Change], *, replay_through: int | None = None, upward: Sequence[float] = (),
    refine: Sequence[float] = (),
) -> ProbePlan | None:
    """The probe of a retry that makes ``changes`` to ``eff``: none unless one moves the LR. Its candidates: the
    new LR, then each ``spacing`` times the previous, floored at ``min_lr`` (a candidate at the floor is the last).
    None when the probe is off for this run's length or there are fewer than two distinct candidates.

    ``upward`` (the caller's, see ``upward_lrs``): LRs above the ended attempt's, ascending. The first is probed
    first, in place of the lowest cut candidate, so the planned probe costs what it did and spans both directions;
    the rest are its extension (``ProbePlan.extend``). ``refine`` (the caller's, see ``refine_above``): LRs between
    the cut and the ended attempt's, also an extension; not with a replay, which tries the ended LR itself.

    When the retry also adds a warmup to a schedule that had none (``warmup_change``: an early divergence), the plan
    takes it back should the chosen candidate train cleanly (``if_clean``): that candidate trained its steps at a
    constant LR from the very start point, so the warmup buys no stability, and it costs a short run's final loss
    (with the re-warm dropped too, the development half's RNN retry ends at 1.04x its reference instead of 1.09x;
    BENCHMARKS.md, 2026-12-05).

    ``replay_through`` (the caller's, see ``replay_steps``): the ended attempt was stopped that many steps after the
    retry's start point. The first candidate then replays the ended attempt's settings (``ProbePlan.replay``): the
    same start point, weights, batches and LR, now held constant at its peak, through the step that diverged
    (``replay_through + 1`` steps, ``ProbePlan.replay_steps``). A deterministic divergence recurs there and the
    candidate fails at no cost beyond those steps; one that does not recur (a transient fault: a one-off NaN, a bit
    flip, a bad node) was not the settings' doing, and the attempt then trains as the ended one did instead of with
    a cut LR it does not need (a NaN at step 3 of a 150-step run ended 1.42x its reference at the cut LR;
    BENCHMARKS.md, 2026-12-06). A clean replay ends the probe: the other candidates would only tune an LR that was
    not at fault. The replay may take at most the steps of the whole probe it would replace (candidates x steps):
    a clean one then costs no more than the probe, and one that fails at most doubles it. Bounding it by one
    candidate's steps instead left a late transient unreplayed whenever it struck more than that many steps after
    the newest checkpoint (a NaN at step 110, 10 steps after a checkpoint, with a 10-step probe: the LR was cut 2x
    for nothing; BENCHMARKS.md, 2026-12-06, the fourth fresh set)."""
    cfg, floor = eff.recovery.lr_probe, eff.recovery.min_lr
    new_lr = next((c.new for c in changes if c.path == LR), None)
    if new_lr is None or not cfg.active(eff.training.max_steps):
        return None
    candidates = [new_lr]
    wanted = cfg.candidates - bool(upward)
    while len(candidates) < wanted and candidates[-1] > floor:
        candidates.append(max(candidates[-1] * cfg.spacing, floor))
    if upward:
        candidates.insert(0, upward[0])
    if len(candidates) < 2:
        return None
    steps = cfg.steps_for(eff.training.max_steps)
    replay: dict[str, Any] = {}
    through = 0 if replay_through is None else replay_through + 1
    if replay_through is not None and 1 <= through <= len(candidates) * steps and eff.optimizer.lr > new_lr:
        doc = recipe_to_dict(eff)
        replay = {c.path: get_path(doc, c.path) for c in changes}
        candidates.insert(0, eff.optimizer.lr)
    if_clean: dict[str, Any] = {}
    if eff.schedule.resolved_warmup_steps(eff.training.max_steps) == 0 and any(c.path == WARMUP for c in changes):
        if_clean = {WARMUP: eff.schedule.warmup_steps}
        if any(c.path == WARMUP_FRACTION for c in changes):
            if_clean[WARMUP_FRACTION] = eff.schedule.warmup_fraction
    extend = tuple(upward[1:]) if upward else () if replay else tuple(r for r in refine if r > max(candidates))
    return ProbePlan(candidates=tuple(candidates), steps=steps, if_clean=if_clean, replay=replay,
                     replay_steps=through if replay else 0, extend=extend)


def upward_lrs(
    detector: str | None, ended_lr: float, spacing: float, diverged_lrs: Sequence[float], count: int
) -> tuple[float, ...]:
    """The LRs above the ended attempt's that the retry's probe also tries (empty: none), ascending: up to
    ``count``, each ``1 / spacing`` times the one before from ``ended_lr``. Only after a run that never learned
    (``never_learned``), only below every LR at which an attempt of the run ended for another reason
    (``diverged_lrs``: there the LR is known to be too high), and never above the LR a recipe may hold (``MAX_LR``).
    The first replaces the lowest cut candidate; the others extend the probe only while the highest LR tried is the
    best (``ProbePlan.extend``).

    Why: a loss that covers almost none of its way to the floor is what a too-low LR gives as surely as a blow-up
    that knocked the model flat, and nothing the ended run measured tells them apart; a cut alone then walks the
    wrong way every time. A short run from the same start at LRs above and below does tell: a too-high one fails
    or ends higher. And where the LR was far too low, one step up per retry costs a whole early check each (an LSTM
    on the copy task at Adam 1e-3 never learned, every retry cut the LR while its probes picked their highest
    candidate, and the run failed at 1.61x its steps; it learns at 4e-3 and above. BENCHMARKS.md, 2026-12-06).
    Not after a stall or a collapse: those say the LR the run descended at is too high."""
    if detector != NEVER_LEARNED:
        return ()
    ups: list[float] = []
    while len(ups) < count:
        up = ended_lr / spacing ** (len(ups) + 1)
        if up > MAX_LR or any(up >= lr for lr in diverged_lrs):
            break
        ups.append(up)
    return tuple(ups)


def refine_above(
    detector: str | None, ended_lr: float, new_lr: float, stopped_after: int | None, steps: int
) -> tuple[float, ...]:
    """The LR between the cut and the ended attempt's that the retry's probe also tries (empty: none): their
    geometric mean, as an extension (``ProbePlan.extend``), so it trains only when the cut itself scored best and
    trained cleanly. The worker then has stopped descending at the second candidate (it stops once one scores worse
    than one above it), so with three candidates or more (the default) the probe trains no more runs than planned.
    Only after an end the detectors stopped (not ``never_learned``, which looks above the ended LR itself,
    ``upward_lrs``) within the probe's own span of its start point (``stopped_after``: the step that failed, counted
    from the retry's start as ``replay_steps`` counts it, so a candidate reaches it within its ``steps``).

    Why: the cut is a fixed factor below an LR that failed, and when the highest candidate is the best the better LR
    may lie between them (full-batch GD 1.1x past its stability limit cut 4x trains at a quarter of the LR that
    would have been stable). Only within the probe's span, because a probe can vouch for an LR over no more steps
    than it runs: there the ended LR failed within that span from the same start, so a clean candidate between is
    evidence; after a late divergence a short clean run says nothing about the steps where the LR failed."""
    if detector is None or detector == NEVER_LEARNED or stopped_after is None or not 0 <= stopped_after < steps:
        return ()
    if not ended_lr > new_lr > 0:
        return ()
    return ((ended_lr * new_lr) ** 0.5,)


def replay_steps(
    detector: str | None, stopped_at: int | None, *, resume_step: int, used: int, skip_data_window: bool
) -> int | None:
    """How many steps after ``resume_step`` the ended attempt was stopped (at ``stopped_at``, by ``detector``) when
    a probe may replay it (``probe_plan``'s ``replay_through``); None when it may not: only on the first numeric
    retry (a replay that was chosen and diverged again leaves the next retry to cut as before), only after an end
    detected at one step (``REPLAYABLE_KINDS``), and not when the retry skips the data window (the batches differ)."""
    if used or skip_data_window or detector not in REPLAYABLE_KINDS or stopped_at is None:
        return None
    return stopped_at - resume_step


def apply_probe_result(
    overrides: Mapping[str, Any], plan: Mapping[str, Any], reason: str | None, result: Mapping[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], str] | None:
    """An attempt's ``(overrides, plan, reason)`` once its worker reports the probe (an ``lr_probe`` event): the LR
    override becomes the chosen LR (the next retry tightens from it, and a crash restart resumes at it), the plan
    keeps the probe's result (``chosen``, ``steps_run``, ``candidates_run``) and the reason says what was chosen.
    When the chosen candidate trained cleanly the worker also dropped the re-warm (the plan's ``rewarm_steps`` becomes
    0) and the warmup the retry added (``if_clean``: its override goes back), so a crash restart and the next retry
    start from what the attempt really trained with. None when there is nothing to change: the result is already
    recorded (a redelivered event), or it names no LR."""
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
        if new_overrides[LR][0] == float(chosen):  # a replay of the recipe's own LR: no override left
            del new_overrides[LR]
    new_plan = {**plan, "lr_probe": probe}
    if result.get("rewarm_steps") == 0:  # a clean pick: the worker trains without the re-warm
        new_plan["rewarm_steps"] = 0
    taken_back = result.get("if_clean")
    if isinstance(taken_back, Mapping):  # ... and without the warmup the retry added: so does the next attempt
        for path, value in taken_back.items():
            if path in new_overrides:
                original = new_overrides[path][0]
                if value == original:
                    del new_overrides[path]
                else:
                    new_overrides[path] = [original, value]
    text = str(result.get("reason") or f"lr probe chose {chosen}")
    return new_overrides, new_plan, f"{reason}; {text}" if reason else text
