"""What an attempt's start and end mean for its run: record the outcome, ask the recovery policy, apply the rules.

``conclude`` ends an attempt (succeeded, diverged, crashed, cancelled, config_error). A config error (a
deterministic setup error: found by the preflight probe, by the workers' setup or at launch) fails the run at once
with its message; the policy is not asked, since no retry can fix it. After a divergence or a crash (and no
cancel requested) the policy (``orchestrator.policy.recovery.decide``) is asked over the store's history first;
a checkpoint it picks that fails verification is marked corrupt and the policy asked again. Its decision is
recorded (a new pending attempt, or the reason to give up), and the rules (``orchestrator.policy.rules``) say
which state changes follow; they are applied through the store, which writes the audit log.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from contracts.recipe import RecipeError
from contracts.wire import one_line
from orchestrator.policy.recovery import GiveUp, RecoveryPlan, decide
from orchestrator.policy.rules import Decision, Happening, Note, Situation, Why, resolve
from orchestrator.policy.states import TERMINAL_ATTEMPT_STATES, AttemptState, RunState
from orchestrator.scheduler.context import Context, release_if_done
from orchestrator.scheduler.failures import Failure
from orchestrator.store.checkpoints import mark_corrupt, verify_checkpoint
from orchestrator.store.ingest import jsonable
from orchestrator.store.models import Attempt, CheckpointRow, Run
from orchestrator.store.records import StoredOutcome, end_event_data, run_checkpoints, run_history, with_verdict
from orchestrator.store.transitions import apply_transitions

log = logging.getLogger("ballast.scheduler")

PREFLIGHT = "preflight"
"""The channel's preflight result (``status``, ``seconds``, ``error``) in ``attempts.ray_info``."""
STAGE = "stage"
"""Where a config error was found (``preflight``, ``setup``, ``launch``): in ``attempts.outcome`` and the log."""
MAX_POLICY_ROUNDS = 8
"""Times the policy is asked again after its chosen checkpoint turned out corrupt."""
RECOVERABLE = (AttemptState.diverged, AttemptState.crashed)

InPlace = Callable[[Attempt], str | None]
"""Prepares the next attempt to continue in the same worker group; returns why it can (the reason for its
``running`` hop), or None when it cannot (then a new worker group is started for it later)."""


@dataclass(frozen=True)
class Next:
    """What follows an attempt's end: the next attempt (recorded, pending) and whether to launch it now."""

    attempt: Attempt | None = None
    launch: bool = False

    @property
    def to_launch(self) -> int | None:
        return self.attempt.number if self.launch and self.attempt is not None else None


@dataclass
class FollowUp:
    """The policy's decision, recorded: the decision, the new attempt, the words for the rules' hops."""

    decision: Decision = Decision.NONE
    attempt: Attempt | None = None
    notes: dict[Why, Note] = field(default_factory=dict)


def summary(attempt: Attempt) -> str:
    """One line: how the attempt ended."""
    stored = StoredOutcome.read(attempt.outcome)
    end, n = stored.end, attempt.number
    outcome = stored.verdict or attempt.state
    if outcome == AttemptState.succeeded.value:
        return f"attempt {n} succeeded after {end.final_step if end is not None else attempt.last_step} steps"
    if outcome == AttemptState.diverged.value:
        what = (end.detector if end is not None else None) or "anomaly"
        if end is None:
            return f"attempt {n} diverged ({what})"
        onset = end.onset_step if end.onset_step is not None else end.final_step
        return f"attempt {n} diverged: onset at step {onset}, detected at step {end.final_step} ({what})"
    if outcome == AttemptState.crashed.value:
        return f"attempt {n} crashed: {one_line(stored.error)}"
    if outcome == AttemptState.config_error.value:
        return f"attempt {n} cannot run as configured: {one_line(stored.error or (end.reason if end else None))}"
    return f"attempt {n} {outcome}"


def workers_started(s: Session, run: Run, attempt: Attempt, *, current: bool, note: Note) -> None:
    """An attempt's first events arrived: it runs, and so does the run when it is the group's current one.
    The attempt's ``running`` hop carries its preflight result, when it had one."""
    started = resolve(Situation(Happening.WORKERS_STARTED, attempt=AttemptState(attempt.state),
                                run=RunState(run.state) if current else None))
    notes = {Why.EVENT: note}
    preflight = (attempt.ray_info or {}).get(PREFLIGHT)
    if isinstance(preflight, dict):
        notes[Why.STARTED] = Note(f"workers started ({preflight_text(preflight)})", {PREFLIGHT: preflight})
    apply_transitions(session=s, resolution=started, run=run, attempt=attempt, notes=notes)


def record_preflight(attempt: Attempt, preflight: Mapping[str, Any]) -> None:
    """Keep the channel's preflight result on the attempt (``ray_info.preflight``), once."""
    if PREFLIGHT not in (attempt.ray_info or {}):
        attempt.ray_info = {**(attempt.ray_info or {}), PREFLIGHT: jsonable(dict(preflight))}


def preflight_text(preflight: Mapping[str, Any]) -> str:
    """``preflight ok in 1.8 s``, or what it said when it was not."""
    took = preflight.get("seconds")
    when = f" in {took:.1f} s" if isinstance(took, int | float) else ""
    said = f": {preflight['error']}" if preflight.get("error") else ""
    return f"preflight {preflight.get('status', 'unknown')}{when}{said}"


def conclude(ctx: Context, s: Session, run: Run, attempt: Attempt, outcome: AttemptState,
             failure: Failure | None = None, *, in_place: InPlace | None = None, stage: str | None = None) -> Next:
    """End ``attempt`` with ``outcome``; the run ends, or the policy's next attempt is recorded (``Next``).

    A config error's ``failure`` is its message (it names the field), kept as it is; ``stage`` says where it was
    found (``preflight``, ``setup``, ``launch``) and is recorded with it."""
    short = detail = None
    if failure is not None and outcome is AttemptState.config_error:
        short = one_line(failure.text, 1000, empty="a setup error without a message")
        detail = failure.text if short != failure.text.strip() else None
    elif failure is not None and (failure.text or failure.workers):
        short = failure.summary()
        detail = failure.text if short != failure.text.strip() else None
    attempt.outcome = jsonable(with_verdict(attempt.outcome, outcome.value, short, detail))
    if stage is not None:
        attempt.outcome = {**attempt.outcome, STAGE: stage}
    said = summary(attempt)
    follow = FollowUp()
    if outcome in RECOVERABLE and not run.cancel_requested:
        if outcome is AttemptState.crashed:
            _note_corrupt_parent(s, attempt, failure)
        follow = follow_up(ctx, s, run, attempt, outcome, in_place=in_place)
    ended = resolve(Situation(Happening.ENDED, run=RunState(run.state), attempt=AttemptState(attempt.state),
                              outcome=outcome, decision=follow.decision, cancel_requested=run.cancel_requested))
    event = Note(said, {STAGE: stage} if stage is not None else None)
    notes = {Why.OUTCOME: Note(said, end_event_data(attempt)), Why.EVENT: event, **follow.notes}
    apply_transitions(session=s, resolution=ended, run=run, attempt=attempt, next_attempt=follow.attempt,
                      notes=notes)
    release_if_done(run)
    return Next(follow.attempt, ended.launch)


def follow_up(ctx: Context, s: Session, run: Run, ended: Attempt, outcome: AttemptState | None = None, *,
              in_place: InPlace | None = None) -> FollowUp:
    """Ask the policy what follows ``ended`` (ended with ``outcome``, or its state) and record its answer."""
    verdict = decide_next(ctx, s, run, ended, outcome)
    if isinstance(verdict, GiveUp):
        return FollowUp(Decision.GIVE_UP, None, {Why.DECISION: Note(verdict.reason)})
    new = attempt_from_plan(s, run, verdict)
    continues = in_place(new) if in_place is not None else None
    if continues is None:
        return FollowUp(Decision.RETRY, new, {Why.DECISION: Note(verdict.reason, {"attempt": new.number})})
    return FollowUp(Decision.IN_PLACE, new, {
        Why.DECISION: Note(verdict.reason, {"attempt": new.number, "in_place": True}),
        Why.IN_PLACE: Note(continues),
    })


def decide_next(ctx: Context, s: Session, run: Run, ended: Attempt,
                outcome: AttemptState | None = None) -> RecoveryPlan | GiveUp:
    """``recovery.decide`` over the store's history; a chosen checkpoint that fails verification is marked
    corrupt and the policy asked again (it then picks the previous one)."""
    try:
        recipe = ctx.recipe(run)
    except RecipeError as exc:
        return GiveUp(f"the stored recipe is invalid: {exc}")
    for _ in range(MAX_POLICY_ROUNDS):
        history = run_history(run, ended, outcome)
        try:
            decision = decide(recipe, history, run_checkpoints(s, run))
        except (ValueError, RecipeError) as exc:
            return GiveUp(f"the recovery policy could not decide: {one_line(exc)}")
        if isinstance(decision, RecoveryPlan) and decision.resume_from is not None:
            row = s.get(CheckpointRow, decision.resume_from.id)
            problem = (verify_checkpoint(row.uri, row.sha256, storage=ctx.settings.checkpoint_storage())
                       if row is not None else "missing")
            if problem is not None and row is not None:
                log.warning("run %s: checkpoint %s is unusable: %s", run.id, row.uri, problem)
                mark_corrupt(s, row, problem)
                continue
        return decision
    return GiveUp("no usable checkpoint: every candidate failed verification")


def attempt_from_plan(s: Session, run: Run, plan: RecoveryPlan) -> Attempt:
    attempt = new_attempt(s, run, kind=plan.kind, reason=plan.reason)
    attempt.parent_checkpoint_id = plan.parent_checkpoint_id
    attempt.resume_step = plan.resume_step
    attempt.overrides = jsonable(plan.overrides_json())
    attempt.plan = jsonable(plan.plan_json())
    if plan.kind == "numeric_retry":
        run.retries_used += 1
    elif plan.kind == "crash_restart":
        run.crash_restarts_used += 1
    run.current_attempt = attempt.number
    s.flush()
    return attempt


def new_attempt(s: Session, run: Run, *, kind: str, reason: str) -> Attempt:
    number = max((a.number for a in run.attempts), default=0) + 1
    attempt = Attempt(run_id=run.id, number=number, state=AttemptState.pending.value, kind=kind,
                      resume_step=0, overrides={}, plan={}, reason=reason, ray_info={})
    run.attempts.append(attempt)
    s.flush()
    return attempt


def _note_corrupt_parent(s: Session, attempt: Attempt, failure: Failure | None) -> None:
    """A crash while loading the checkpoint it resumed from marks that checkpoint corrupt."""
    error = failure.text if failure is not None else None
    if not error or attempt.parent_checkpoint_id is None:
        return
    if "CorruptCheckpoint" in error or "corrupt checkpoint" in error:
        row = s.get(CheckpointRow, attempt.parent_checkpoint_id)
        if row is not None:
            mark_corrupt(s, row, one_line(error))


def worker_group_ended(ctx: Context, s: Session, run: Run, current: Attempt, fit: Mapping[str, Any]) -> Next:
    """The fit returned or failed: map the current attempt's end onto the store."""
    if current.state in TERMINAL_ATTEMPT_STATES:
        return Next()
    stored = StoredOutcome.read(current.outcome)
    verdict = stored.verdict
    if run.cancel_requested or verdict == AttemptState.cancelled.value:
        conclude(ctx, s, run, current, AttemptState.cancelled)
        return Next()
    if verdict in (AttemptState.succeeded.value, AttemptState.diverged.value):
        return conclude(ctx, s, run, current, AttemptState(verdict))
    if verdict == AttemptState.config_error.value:  # rank 0 reported it in its end event
        reason = stored.end.reason if stored.end is not None else ""
        return conclude(ctx, s, run, current, AttemptState.config_error, Failure(reason), stage="setup")
    if fit.get("config_error"):  # the channel's preflight probe found it: no worker group was started
        if isinstance(fit.get(PREFLIGHT), Mapping):
            record_preflight(current, fit[PREFLIGHT])
        return conclude(ctx, s, run, current, AttemptState.config_error, Failure(str(fit["config_error"])),
                        stage=str(fit.get("stage") or "preflight"))
    if fit.get("state") == "failed" and fit.get("error"):
        failure = Failure.of_fit(fit)
        message = failure.config_error()
        if message is not None:  # a rank's setup error, without rank 0's end event
            return conclude(ctx, s, run, current, AttemptState.config_error, Failure(message), stage="setup")
    else:
        failure = Failure("the worker group exited without reporting how the attempt ended")
    return conclude(ctx, s, run, current, AttemptState.crashed, failure)
