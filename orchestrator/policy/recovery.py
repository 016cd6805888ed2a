"""The recovery policy: after an attempt ends, decide the next attempt (or give up). Pure: no I/O, Ray or SQL.

What each knob does is ``orchestrator/policy/tightening.py``; this module decides whether, from where and which.
(Why one file of ~470 lines: the policy below is written out in full as prose, a fifth of the file, and the code
is one decision — budgets, lineage, resume point, changes — that reads best in one place.)

The scheduler builds ``AttemptRecord``s (the run's attempts, oldest first; ``history[-1]`` is the one that just
ended) and ``CheckpointRecord``s (the run's checkpoints) from the store, calls ``decide`` and applies the result:
a ``RecoveryPlan`` becomes a new attempt (``kind``, ``parent_checkpoint_id``, ``resume_step``,
``overrides_json()``, ``plan_json()``, ``reason``); a ``GiveUp`` fails the run with its ``reason``.

Policy (all knobs are the recipe's ``recovery`` section, read from the *effective* recipe):

Budgets. Numeric retries (``kind == "numeric_retry"``) and crash restarts (``"crash_restart"``) are counted
separately, over the attempts since the newest ``manual`` one (a manual retry grants fresh budgets). Steps too
(``step_budget``): a numeric retry is not started when the steps those attempts executed (probes included) plus the
most the retry could execute (its probe's steps, then from its resume step to ``max_steps``) exceed the budget; a
crash restart is not held to it (the run is not at fault, and it resumes where the crash left off).

Lineage. The checkpoints an attempt may resume from are those of its *lineage*: its own, then those of the
attempt it resumed from up to the step it resumed at (``resumed_from_id``; when unknown, the previous attempt
in ``history`` up to ``start_step``), and so on back to a fresh start. A checkpoint of an abandoned branch (say
step 800 of an attempt that diverged at 812 and was rolled back to 600) is never resumed. Ties on step prefer
the newer attempt. A checkpoint at step ``s`` holds the state after ``s`` completed steps, so it is untouched
by an anomaly at step ``onset`` iff ``s <= onset``.

diverged → ``numeric_retry`` (``recovery.strategy: restart_latest`` instead resumes the newest valid checkpoint
with the same settings, the baseline other systems apply):
- Vanishing gradients (kind ``vanishing`` from the outcome verdict, or ``vanishing_gradients`` with a rollback
  action) and overfitting (``overfitting``: the held-out loss rose while the training loss fell) → ``GiveUp``
  with the diagnosis: no tightening of LR or clip can fix them.
- Resume from the **best valid, healthy** lineage checkpoint with ``step <= onset - rollback_margin_steps``: the
  lowest smoothed loss at save time (ties and unknown losses: the newest), so a rollback never lands on a
  checkpoint that had already degraded. (onset: ``onset_step``, else ``final_step``, else ``start_step``). When the
  ended attempt had itself resumed
  (``start_step > 0``, any kind) and diverged within ``early_failure_steps`` of that start, its start point is
  presumed already on the way to divergence: the checkpoint must be strictly older than ``start_step``. A
  checkpoint at or past the run's ``max_steps`` is never a target: it would leave the retry nothing to train. No
  qualifying checkpoint → restart from initialisation (``resume_from=None``, ``resume_step=0``).
- Tighten from the effective settings (recipe + the ended attempt's overrides), the knob the evidence names
  (``tighten_order_for``): ``auto`` lowers the LR first after a loss divergence or a non-finite value whatever the
  optimizer, tightens the clip first after a gradient spike with a healthy loss, and falls back to the optimizer
  family (LR for Adam/AdamW, clip for SGD) for other kinds; an explicit ``tighten_order`` is obeyed. The
  *primary* knob is tightened on every retry; the *secondary* one from the 2nd numeric retry on, or already on the
  1st when the primary is at its floor or when the 1st retry's LR probe replays the ended settings: the replay is
  the recurrence test (it reverts every change), and the cut candidates train only once it has failed, i.e. once
  the divergence has recurred (a x1e4 gradient spike that recurred at step 60 of a 150-step run took three
  attempts when the cut LR alone followed the failed replay, two with the clip too). ``both`` tightens both every
  retry. After a run that never learned, stalled or collapsed, or a divergence in its first 10% of steps, the LR
  moves by ``lr_factor²`` (halving is a guess that rarely suffices there).
- Warmup (``warmup_change``): a divergence in the first 10% of steps of a run without warmup adds one (10% of
  max_steps, at least 10 steps); one during or right after the warmup doubles it; either way the peak LR is
  lowered too.
  - LR: ``lr × lr_factor``, floored at ``min_lr``; never raised (an LR already at/below the floor is at floor).
  - Clip, by ``clipping.method``:
    ``global_norm`` / ``zscore`` (its ``max_norm`` ceiling): ``clip_to_median_multiple × median_grad_norm``
    when both are known *and* that lowers the threshold, else ``max_norm × clip_factor``; floored at
    ``min_clip``, never raised. ``per_layer``: the same with ``clip_factor`` only (the median is of the global
    norm, not per tensor). ``adaptive``: ``agc_lambda × clip_factor``, floored at ``MIN_AGC_LAMBDA`` (a ratio,
    so ``min_clip``, a norm, does not apply). ``none``: turns on ``global_norm`` clipping at the median-based
    threshold when known, else at the recipe's ``max_norm``, floored at ``min_clip``.
    ``median_grad_norm`` is the newest one known in ``history`` (a short retry may not have measured one).
  - fp16 → bf16 (``precision.dtype``) *instead of* the LR/clip tightening above when the dtype is fp16,
    ``fp16_to_bf16`` is on and the ended attempt's loss scale collapsed or its values went non-finite
    (``fp16_overflow``): fp16's range failed, not the step size, so only the dtype changes (cutting the LR as
    well under-trains the retry) and there is no re-warm (the schedule is the recipe's, as it was); if bf16
    diverges too, the next retry tightens as usual.
  - Nothing can change (both knobs at their floors, no dtype switch) → ``GiveUp``.
- LR probe (``recovery.lr_probe``, ``orchestrator/policy/probe.py``): when the retry lowers the LR and the probe is
  active for the run's length, the plan also names candidate LRs (the cut LR, then lower ones); the new attempt
  tries each for a few steps from its start point and trains at the best (``workers/lr_probe.py``), which then
  replaces the cut LR in its overrides (``orchestrator/store/ingest.py``). When the chosen LR trained its probe
  steps cleanly, the attempt trains without the re-warm and without a warmup this retry added for an early
  divergence (``ProbePlan.if_clean``).
- ``rewarm_steps`` from the recipe, except after a dtype switch alone (the LR did not change).
  ``skip_data_window``: ``data_offset += onset - resume_step + 1``, i.e. the batches of steps
  ``resume_step..onset`` *inclusive* are skipped (the onset batch is the likeliest culprit); otherwise the
  offset is carried over. ``data_offset`` shifts the data stream of the whole attempt
  (batch index = step + data_offset).
- ``overrides`` is the cumulative diff against the ORIGINAL recipe, ``{path: (original, new)}``: a knob
  tightened twice reads ``(1e-3, 2.5e-4)``, not ``(5e-4, 2.5e-4)``.

crashed → ``crash_restart``: resume from the newest **valid** lineage checkpoint, healthy or not (the crash is
not numeric, and the run had carried on past that checkpoint under the same settings; if its state was bad the
detectors will say so and the numeric policy rolls back to a healthy one). Invalid (corrupt/deleted) ones are
skipped, so a corrupt newest checkpoint means the previous one. None valid → initialisation. Overrides and
``data_offset`` unchanged, no re-warm, except where the restart resumes from the very point the crashed attempt
started from (it crashed before its first checkpoint): then it is that attempt again, with its plan's re-warm and,
if its LR probe had not chosen yet, the probe.

succeeded / cancelled / config_error → ``ValueError``: there is nothing to recover (a config error fails the run
by its own rule, ``orchestrator/policy/rules.py``), and a ``GiveUp`` would wrongly fail the run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from contracts.overrides import apply_overrides, get_path
from contracts.recipe import DType, Recipe, Recovery, RecoveryStrategy, TightenOrder
from contracts.wire import ProbePlan, one_line
from orchestrator.policy.probe import probe_plan, refine_above, replay_steps, upward_lrs
from orchestrator.policy.tightening import (
    AGC,
    DTYPE,
    EARLY_FRACTION,
    HOPELESS,
    HOPELESS_KINDS,
    LR,
    MAX_NORM,
    METHOD,
    NEVER_LEARNED,
    NO_PROGRESS_KINDS,
    Change,
    Knob,
    num,
    tighten_clip,
    tighten_lr,
    tighten_order_for,
    warmup_change,
)

ATTEMPT_KINDS = frozenset({"initial", "numeric_retry", "crash_restart", "manual"})
OUTCOMES = frozenset({"diverged", "crashed", "succeeded", "cancelled", "config_error"})


# ------------------------------------------------------------------------------------------------ records
@dataclass(frozen=True)
class AttemptRecord:
    """One attempt as the policy needs it (built by the scheduler from the ``attempts`` row)."""

    number: int
    kind: str
    """initial | numeric_retry | crash_restart | manual"""
    outcome: str
    """diverged | crashed | succeeded | cancelled"""
    start_step: int
    """Step the attempt resumed from (0 for a fresh start)."""
    onset_step: int | None = None
    """diverged: first anomalous step."""
    final_step: int | None = None
    """Last step reached."""
    detector: str | None = None
    """Kind of the anomaly that ended it (e.g. grad_norm_spike)."""
    value: float | None = None
    """Observed value of that anomaly."""
    overrides: Mapping[str, Any] = field(default_factory=dict)
    """The attempt's effective settings as a diff vs the recipe: {"optimizer.lr": (old, new)} (lists too)."""
    data_offset: int = 0
    loss_scale_collapsed: bool = False
    median_grad_norm: float | None = None
    """Median healthy pre-clip global grad norm observed."""
    error: str | None = None
    """crashed: what happened."""
    resumed_from_id: int | None = None
    """Id of the checkpoint it resumed from (the attempt's parent_checkpoint_id)."""
    rewarm_steps: int = 0
    """The re-warm its plan asked for."""
    pending_probe: ProbePlan | None = None
    """The LR probe its plan asked for, while no choice is recorded (it had not finished)."""
    probe_steps: int = 0
    """Steps its LR probe trained (0: it ran none, or the probe's result was not recorded)."""

    @property
    def steps_executed(self) -> int:
        """Steps it trained, its probe's included (a crash before any step reported: 0)."""
        end = self.final_step if self.final_step is not None else self.start_step
        return max(0, end - self.start_step) + self.probe_steps

    def __post_init__(self) -> None:
        if self.kind not in ATTEMPT_KINDS:
            raise ValueError(f"AttemptRecord.kind: {self.kind!r} is not one of {sorted(ATTEMPT_KINDS)}")
        if self.outcome not in OUTCOMES:
            raise ValueError(f"AttemptRecord.outcome: {self.outcome!r} is not one of {sorted(OUTCOMES)}")
        if self.number < 1:
            raise ValueError(f"AttemptRecord.number: must be >= 1, got {self.number}")
        if self.start_step < 0:
            raise ValueError(f"AttemptRecord.start_step: must be >= 0, got {self.start_step}")
        if self.data_offset < 0:
            raise ValueError(f"AttemptRecord.data_offset: must be >= 0, got {self.data_offset}")
        if self.probe_steps < 0:
            raise ValueError(f"AttemptRecord.probe_steps: must be >= 0, got {self.probe_steps}")


@dataclass(frozen=True)
class CheckpointRecord:
    id: int
    attempt_number: int
    step: int
    uri: str
    healthy: bool
    valid: bool = True
    """False: corrupt or deleted."""
    loss: float | None = None
    """The smoothed training loss when it was saved (the rollback goes to the best, not the newest)."""


@dataclass(frozen=True)
class RecoveryPlan:
    kind: str
    """numeric_retry | crash_restart"""
    resume_from: CheckpointRecord | None
    """None: restart from initialisation."""
    resume_step: int
    overrides: dict[str, tuple[Any, Any]]
    """Cumulative diff vs the ORIGINAL recipe: what the new attempt runs with."""
    rewarm_steps: int
    data_offset: int
    reason: str
    """One line a person can read."""
    lr_probe: ProbePlan | None = None
    """The LRs the new attempt probes before it trains (``orchestrator/policy/probe.py``); None: none."""

    @property
    def parent_checkpoint_id(self) -> int | None:
        return self.resume_from.id if self.resume_from is not None else None

    def overrides_json(self) -> dict[str, list[Any]]:
        """The overrides in the store's form: ``{"optimizer.lr": [old, new]}``."""
        return {path: [old, new] for path, (old, new) in self.overrides.items()}

    def plan_json(self) -> dict[str, Any]:
        """The attempt's ``plan`` column: what the workers need besides the effective recipe."""
        plan: dict[str, Any] = {
            "rewarm_steps": self.rewarm_steps,
            "data_offset": self.data_offset,
            "resume_uri": self.resume_from.uri if self.resume_from is not None else None,
        }
        if self.lr_probe is not None:
            plan["lr_probe"] = self.lr_probe.to_dict()
        return plan


@dataclass(frozen=True)
class GiveUp:
    reason: str


# -------------------------------------------------------------------------------------------- overrides
def normalize_overrides(overrides: Mapping[str, Any] | None) -> dict[str, tuple[Any, Any]]:
    """``{path: [old, new]}`` (store) or ``{path: (old, new)}`` → ``{path: (old, new)}``."""
    out: dict[str, tuple[Any, Any]] = {}
    for path, change in (overrides or {}).items():
        if not isinstance(change, list | tuple) or len(change) != 2:
            raise ValueError(f"overrides.{path}: must be [old, new], got {change!r}")
        out[path] = (change[0], change[1])
    return out


def effective_recipe(recipe: Recipe, overrides: Mapping[str, Any] | None) -> Recipe:
    """The recipe an attempt runs with (``contracts.overrides.apply_overrides``; re-validated)."""
    return apply_overrides(recipe, normalize_overrides(overrides))


def effective_values(recipe: Recipe, overrides: Mapping[str, Any] | None) -> dict[str, Any]:
    """The settings the policy tightens, as JSON values, under ``overrides``."""
    eff = effective_recipe(recipe, overrides)
    return {
        "optimizer.name": eff.optimizer.name.value,
        LR: eff.optimizer.lr,
        METHOD: eff.clipping.method.value,
        MAX_NORM: eff.clipping.max_norm,
        AGC: eff.clipping.agc_lambda,
        DTYPE: eff.precision.dtype.value,
    }


# ------------------------------------------------------------------------------------------- formatting
def _ended(last: AttemptRecord, onset: int | None = None) -> str:
    if last.outcome == "crashed":
        return f"attempt {last.number} crashed ({one_line(last.error, 200, empty='no error recorded')})"
    what = last.detector or "anomaly"
    if last.value is not None:
        what += f"={num(last.value)}"
    where = f"onset at step {onset}, " if onset is not None else ""
    return f"attempt {last.number} diverged ({where}{what})"


# ---------------------------------------------------------------------------------------------- lineage
def _order(c: CheckpointRecord) -> tuple[int, int, int]:
    return (c.step, c.attempt_number, c.id)


def _lineage(history: Sequence[AttemptRecord], checkpoints: Sequence[CheckpointRecord]) -> list[CheckpointRecord]:
    """Checkpoints on the path that led to the ended attempt's state (see the module docstring)."""
    by_id = {c.id: c for c in checkpoints}
    index_of = {a.number: i for i, a in enumerate(history)}
    found: dict[int, CheckpointRecord] = {}
    idx: int | None = len(history) - 1
    up_to = math.inf
    visited: set[int] = set()
    while idx is not None and idx not in visited:
        visited.add(idx)
        a = history[idx]
        for c in checkpoints:
            if c.attempt_number == a.number and c.step <= up_to:
                found[c.id] = c
        parent = by_id.get(a.resumed_from_id) if a.resumed_from_id is not None else None
        if parent is not None:
            if parent.step <= up_to:
                found[parent.id] = parent
            up_to = min(up_to, parent.step)
            nxt = index_of.get(parent.attempt_number)
            idx = nxt if nxt is not None and history[nxt].number < a.number else None
        elif a.start_step > 0 and idx > 0:
            up_to = min(up_to, a.start_step)
            idx -= 1
        else:  # a fresh start: nothing came before it
            idx = None
    return sorted(found.values(), key=_order)


# ----------------------------------------------------------------------------------------------- policy
def decide(
    recipe: Recipe, history: Sequence[AttemptRecord], checkpoints: Sequence[CheckpointRecord]
) -> RecoveryPlan | GiveUp:
    """The next attempt after ``history[-1]`` ended, or why there is none (policy: module docstring)."""
    if not history:
        raise ValueError("history: empty; decide needs the attempt that just ended as history[-1]")
    last = history[-1]
    if last.outcome in ("succeeded", "cancelled", "config_error"):
        # a config error is not recovered from: no retry can fix the recipe (the run fails, see rules.py)
        raise ValueError(f"history[-1].outcome: attempt {last.number} {last.outcome}; there is nothing to recover")
    budgeted = since_manual(history)
    eff = effective_recipe(recipe, last.overrides)
    lineage = _lineage(history, checkpoints)
    if last.outcome == "crashed":
        used = sum(1 for a in budgeted if a.kind == "crash_restart")
        return _crash_restart(eff, last, lineage, used)
    used = sum(1 for a in budgeted if a.kind == "numeric_retry")
    if eff.recovery.strategy is RecoveryStrategy.restart_latest:
        return _restart_latest(eff, last, lineage, used)
    return _numeric_retry(recipe, eff, history, budgeted, lineage, used)


def since_manual(history: Sequence[AttemptRecord]) -> list[AttemptRecord]:
    """The attempts the budgets count: those after the newest ``manual`` retry (which grants fresh ones)."""
    for i in range(len(history) - 1, -1, -1):
        if history[i].kind == "manual":
            return list(history[i + 1 :])
    return list(history)


def over_step_budget(
    budget: float | None, max_steps: int, budgeted: Sequence[AttemptRecord], *, resume_step: int,
    probe: ProbePlan | None,
) -> str | None:
    """Why a numeric retry resuming at ``resume_step`` with ``probe`` would overrun ``step_budget`` (a multiple of
    ``max_steps``) after the ``budgeted`` attempts, or None when it fits (or there is no budget). The retry is
    charged the most it could execute, so a run never ends past its budget."""
    if budget is None:
        return None
    allowed = int(budget * max_steps)
    spent = sum(a.steps_executed for a in budgeted)
    need = max(0, max_steps - resume_step) + (probe.max_steps if probe is not None else 0)
    if spent + need <= allowed:
        return None
    return (f"step budget exhausted: the attempts so far executed {spent} steps and the retry from step "
            f"{resume_step} could need {need} more, past the budget of {allowed} ({budget:g}x max_steps "
            f"{max_steps}; recovery.step_budget)")


def _restart_latest(
    eff: Recipe, last: AttemptRecord, lineage: list[CheckpointRecord], used: int
) -> RecoveryPlan | GiveUp:
    """The baseline other systems apply to every failure: the newest valid checkpoint, the same settings."""
    budget = eff.recovery.max_retries
    if used >= budget:
        return GiveUp(f"{_ended(last, last.onset_step)}; numeric retry budget exhausted ({used}/{budget})")
    return _resume_newest(last, lineage, kind="numeric_retry", ended=_ended(last, last.onset_step),
                          note=" (strategy restart_latest)")


def _crash_restart(
    eff: Recipe, last: AttemptRecord, lineage: list[CheckpointRecord], used: int
) -> RecoveryPlan | GiveUp:
    budget = eff.recovery.max_crash_restarts
    if used >= budget:
        return GiveUp(f"{_ended(last)}; crash restart budget exhausted ({used}/{budget})")
    plan = _resume_newest(last, lineage, kind="crash_restart", ended=_ended(last), note="")
    if plan.parent_checkpoint_id != last.resumed_from_id or not (last.rewarm_steps or last.pending_probe):
        return plan
    # it crashed before its first checkpoint: the restart is that attempt again, with its re-warm, and its probe
    # when that had not chosen (else a crash mid-probe would train at the cut LR untried)
    redo = [f"re-warm {last.rewarm_steps} steps"] if last.rewarm_steps else []
    if last.pending_probe is not None:
        redo.append(_probe_text(last.pending_probe, last.rewarm_steps))
    return replace(plan, rewarm_steps=last.rewarm_steps, lr_probe=last.pending_probe,
                   reason=f"{plan.reason}; it crashed before its first checkpoint, so again {' and '.join(redo)}")


def _probe_text(probe: ProbePlan, rewarm: int) -> str:
    text = f"lr probe of {', '.join(num(c) for c in probe.candidates)} for {probe.steps} steps each"
    ramps = (["the re-warm"] if rewarm else []) + (["the added warmup"] if probe.if_clean else [])
    if ramps:
        text += f" ({' and '.join(ramps)} {'go' if len(ramps) > 1 else 'goes'} if the chosen LR trains cleanly)"
    if probe.replay:
        text += (f"; the first replays the diverged settings through the step that failed ({probe.replay_steps} "
                 "steps; kept if it trains cleanly)")
    return text


def _resume_newest(
    last: AttemptRecord, lineage: list[CheckpointRecord], *, kind: str, ended: str, note: str
) -> RecoveryPlan:
    """Resume from the newest valid lineage checkpoint (healthy or not) with the settings unchanged."""
    valid = [c for c in lineage if c.valid]
    resume = valid[-1] if valid else None
    floor = resume.step if resume is not None else -1
    skipped = [c.step for c in lineage if not c.valid and c.step > floor]
    where = f"resumed from step {resume.step}" if resume is not None else "restarted from initialisation"
    reason = f"{ended}; {where} with unchanged settings{note}"
    if skipped:
        reason += f" (skipped invalid checkpoint{'s' if len(skipped) > 1 else ''} at step "
        reason += ", ".join(str(s) for s in sorted(skipped, reverse=True)) + ")"
    elif resume is None:
        reason += " (no valid checkpoint)"
    return RecoveryPlan(
        kind=kind,
        resume_from=resume,
        resume_step=resume.step if resume is not None else 0,
        overrides=normalize_overrides(last.overrides),
        rewarm_steps=0,
        data_offset=last.data_offset,
        reason=reason,
    )


def best_checkpoint(candidates: Sequence[CheckpointRecord]) -> CheckpointRecord | None:
    """The checkpoint to roll back to: the lowest smoothed loss (ties and unknown losses: the newest)."""
    if not candidates:
        return None
    known = [c for c in candidates if c.loss is not None and math.isfinite(c.loss)]
    if not known:
        return max(candidates, key=_order)
    return min(known, key=lambda c: (c.loss, tuple(-x for x in _order(c))))


def _numeric_retry(
    recipe: Recipe,
    eff: Recipe,
    history: Sequence[AttemptRecord],
    budgeted: Sequence[AttemptRecord],
    lineage: list[CheckpointRecord],
    used: int,
) -> RecoveryPlan | GiveUp:
    """``budgeted``: the attempts the budgets count (``since_manual``); ``history[-1]`` is the one that ended."""
    last = history[-1]
    rec = eff.recovery
    onset = next((s for s in (last.onset_step, last.final_step) if s is not None), last.start_step)
    if used >= rec.max_retries:
        return GiveUp(f"{_ended(last, onset)}; numeric retry budget exhausted ({used}/{rec.max_retries})")
    if last.detector in HOPELESS_KINDS:
        return GiveUp(f"{_ended(last, onset)}; {HOPELESS[last.detector]}")
    tightened = _tightening(eff, history, last, onset, used)
    if isinstance(tightened, str):
        return GiveUp(f"{_ended(last, onset)}; nothing left to tighten ({tightened})")
    changes, texts, on_recurrence = tightened
    resume, where = _resume_point(rec, lineage, last, onset, eff.training.max_steps)
    resume_step = resume.step if resume is not None else 0
    replay = replay_steps(last.detector, last.final_step, resume_step=resume_step, used=used,
                          skip_data_window=rec.skip_data_window)
    upward, refine = _beyond_the_cut(recipe, eff, budgeted, last, changes, resume_step)
    probe = probe_plan(eff, changes, replay_through=replay, upward=upward, refine=refine)
    if probe is not None and probe.replay and on_recurrence is not None:
        # the replay is the recurrence test: only if it fails do the other candidates train, and a divergence that
        # recurs at the same settings from the same point turns the second knob too (the replay reverts it)
        changes = [*changes, *on_recurrence.changes]
        texts.append(f"{on_recurrence.text} (with the cut LR, should the replay show it recurs)")
        probe = probe_plan(eff, changes, replay_through=replay)
    over = over_step_budget(rec.step_budget, eff.training.max_steps, budgeted, resume_step=resume_step, probe=probe)
    if over is not None:
        return GiveUp(f"{_ended(last, onset)}; {over}")
    overrides = _cumulative(recipe, last, changes)
    if probe is not None and LR not in overrides:
        # a cut back to the recipe's own LR (after an upward probe chose one above it): kept, for the probe's choice
        # replaces this override (``apply_probe_result``) and must not be lost for want of one
        overrides[LR] = (recipe.optimizer.lr, recipe.optimizer.lr)
    # a re-warm eases a *changed* step size in; a dtype switch alone keeps the LR and its schedule as they were
    rewarm = 0 if all(c.path == DTYPE for c in changes) else rec.rewarm_steps
    if rewarm:
        texts.append(f"re-warm {rewarm} steps")
    if probe is not None:
        texts.append(_probe_text(probe, rewarm))
        if probe.extend or (upward and probe.candidates[0] == upward[0]):
            texts.append(_beyond_the_cut_text(probe, upward, (last.final_step or 0) - resume_step))
    data_offset = last.data_offset
    if rec.skip_data_window:
        data_offset += max(0, onset - resume_step + 1)
        texts.append(f"skipped data {resume_step}–{onset}")
    return RecoveryPlan(
        kind="numeric_retry",
        resume_from=resume,
        resume_step=resume_step,
        overrides=overrides,
        rewarm_steps=rewarm,
        data_offset=data_offset,
        reason=f"{_ended(last, onset)}; {where}; " + ", ".join(texts),
        lr_probe=probe,
    )


def _beyond_the_cut(
    recipe: Recipe, eff: Recipe, budgeted: Sequence[AttemptRecord], last: AttemptRecord, changes: Sequence[Change],
    resume_step: int,
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """The LRs the retry's probe tries besides its cuts: above the ended LR after a run that never learned
    (``upward_lrs``), or between the cut and the ended LR after an early failure (``refine_above``)."""
    rec = eff.recovery
    if last.detector == NEVER_LEARNED:
        too_high = [effective_recipe(recipe, a.overrides).optimizer.lr for a in budgeted
                    if a.outcome == "diverged" and a.detector != NEVER_LEARNED]
        # as many upward LRs as twice the probe's candidates: the probe's own cost again at most, and room to climb
        # 4^6 = 4096x (an LR 200x below its reference's took five steps up on the eighth fresh set)
        return upward_lrs(last.detector, eff.optimizer.lr, rec.lr_probe.spacing, too_high,
                          2 * rec.lr_probe.candidates), ()
    new_lr = next((c.new for c in changes if c.path == LR), None)
    if new_lr is None or last.final_step is None:
        return (), ()
    return (), refine_above(last.detector, eff.optimizer.lr, new_lr, last.final_step - resume_step,
                            rec.lr_probe.steps_for(eff.training.max_steps))


def _beyond_the_cut_text(probe: ProbePlan, upward: Sequence[float], stopped_after: int) -> str:
    if not upward:
        return (f"then {num(probe.extend[0])}, between the cut and the LR that failed, should the cut score best "
                f"(the attempt failed at step {stopped_after + 1} from this start point, within the probe's span)")
    text = (f"the first, {num(upward[0])}, is above the attempt's LR: a run that never learned may have "
            "trained too slowly, and the probe shows which way the loss falls faster")
    if probe.extend:
        text += f"; then {', '.join(num(c) for c in probe.extend)} while the highest tried is the best"
    return text


def _tightening(
    eff: Recipe, history: Sequence[AttemptRecord], last: AttemptRecord, onset: int, used: int
) -> tuple[list[Change], list[str], Knob | None] | str:
    """The changes the evidence calls for, their texts and the knob a recurrence would add (the secondary one when
    it was held back; None: none), or (a str) why nothing can change: the floors."""
    overflow = fp16_overflow(eff, last)
    if overflow:  # fp16's range failed, not the step size: switch the dtype alone (the LR follows if it recurs)
        return [Change(DTYPE, DType.bf16.value)], [f"precision fp16→bf16 ({overflow}); lr and clip unchanged"], None
    order = tighten_order_for(eff, last.detector)
    median = next(
        (a.median_grad_norm for a in reversed(history)
         if a.median_grad_norm is not None and math.isfinite(a.median_grad_norm) and a.median_grad_norm > 0),
        None,
    )
    # no progress at all: halving is a guess that rarely suffices, so the LR moves by the factor squared
    strong = last.detector in NO_PROGRESS_KINDS or onset <= max(10, int(EARLY_FRACTION * eff.training.max_steps))
    lr_knob, clip_knob = tighten_lr(eff, strong=strong), tighten_clip(eff, median)
    secondary: Knob | None = None
    if order is TightenOrder.both:
        chosen = [lr_knob, clip_knob]
    else:
        primary, secondary = (lr_knob, clip_knob) if order is TightenOrder.lr_first else (clip_knob, lr_knob)
        chosen = [primary, secondary] if used + 1 >= 2 or not primary.changes else [primary]
    warm = warmup_change(eff, onset)
    if warm.changes and lr_knob not in chosen:
        chosen.append(lr_knob)  # a too-high peak: lower it as well as lengthening the ramp
    moved = [k for k in (*chosen, warm) if k.changes]
    changes = [c for k in moved for c in k.changes]
    texts = [k.text for k in moved]
    if not changes:
        return ", ".join(k.text for k in (lr_knob, clip_knob))
    held_back = secondary if secondary is not None and secondary not in chosen and secondary.changes else None
    return changes, texts, held_back


def fp16_overflow(eff: Recipe, last: AttemptRecord) -> str:
    """Why the ended attempt looks like an fp16 overflow ('' when it does not, or the switch is off or done):
    its dynamic loss scale collapsed, or its loss or gradients went non-finite while training in fp16. Either
    is fp16's narrow range failing (activations or gradients above 65504), which bf16's range fixes."""
    if not eff.recovery.fp16_to_bf16 or eff.precision.dtype is not DType.fp16:
        return ""
    if last.loss_scale_collapsed:
        return "loss scale collapsed"
    if last.detector == "nonfinite":
        return "non-finite values in fp16"
    return ""


def _resume_point(
    rec: Recovery, lineage: list[CheckpointRecord], last: AttemptRecord, onset: int, max_steps: int
) -> tuple[CheckpointRecord | None, str]:
    """The best healthy lineage checkpoint clear of the onset (see the module docstring), and how to say it."""
    limit = min(onset - rec.rollback_margin_steps, max_steps - 1)
    early = last.start_step > 0 and onset - last.start_step <= rec.early_failure_steps
    candidates = [
        c for c in lineage
        if c.valid and c.healthy and c.step <= limit and (not early or c.step < last.start_step)
    ]
    resume = best_checkpoint(candidates)
    where = f"resumed from step {resume.step}" if resume is not None else "restarted from initialisation"
    if resume is not None and resume is not max(candidates, key=_order) and resume.loss is not None:
        where += f" (its best checkpoint, loss {num(resume.loss)}, not the newest)"
    if early:
        where += f" (went further back: it failed {onset - last.start_step} steps after resuming at step "
        where += f"{last.start_step})"
    elif resume is None:
        margin = rec.rollback_margin_steps
        where += f" (no healthy checkpoint {f'{margin}+ steps ' if margin else ''}before the onset)"
    return resume, where


def _cumulative(recipe: Recipe, last: AttemptRecord, changes: Sequence[Change]) -> dict[str, tuple[Any, Any]]:
    """The new attempt's overrides: a cumulative diff against the ORIGINAL recipe, checked against the schema."""
    original = recipe.model_dump(mode="json", by_alias=True)
    overrides = normalize_overrides(last.overrides)
    for ch in changes:
        old = get_path(original, ch.path)
        if ch.new == old:
            overrides.pop(ch.path, None)
        else:
            overrides[ch.path] = (old, ch.new)
    apply_overrides(recipe, overrides)  # the plan must yield a recipe the schema accepts
    return overrides


# ------------------------------------------------------------------------------------------ manual retry
def manual_retry_checkpoint(
    history: Sequence[AttemptRecord], checkpoints: Sequence[CheckpointRecord]
) -> CheckpointRecord | None:
    """Where a manual retry resumes: the best valid, healthy checkpoint of the lineage of ``history[-1]`` (the
    run's last ended attempt; ``best_checkpoint``), as a numeric retry would see it without an onset to stay
    clear of; None (initialisation) when there is none or no attempt has ended."""
    if not history:
        return None
    return best_checkpoint([c for c in _lineage(history, checkpoints) if c.valid and c.healthy])
