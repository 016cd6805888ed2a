"""What a person asks of a run through the API: cancel it, or retry it by hand. Keyword arguments, ``add``/``flush``
only; the state changes follow the rules (``orchestrator.policy.rules``) like the scheduler's."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from contracts.overrides import apply_overrides, get_path
from contracts.recipe import Recipe, admitted_modules, recipe_to_dict
from orchestrator.policy.recovery import manual_retry_checkpoint
from orchestrator.policy.rules import Happening, Note, Situation, Why, resolve
from orchestrator.policy.states import (
    TERMINAL_ATTEMPT_STATES,
    TERMINAL_RUN_STATES,
    AttemptState,
    IllegalTransition,
    RunState,
    check_run_transition,
)
from orchestrator.store.models import Attempt, Run, utcnow
from orchestrator.store.records import run_checkpoints, run_history
from orchestrator.store.transitions import apply_transitions

MANUAL_RETRY_KIND = "manual"
RECOVERY_KINDS = ("numeric_retry", "crash_restart", "manual")


def cancel_queued_run(*, session: Session, run: Run, reason: str) -> None:
    """A queued run and its attempt(s) waiting with it end cancelled (on request, or found so when claimed)."""
    note = {Why.EVENT: Note(reason)}
    for att in run.attempts:
        if att.state not in TERMINAL_ATTEMPT_STATES:
            done = resolve(Situation(Happening.CANCELLED_IN_QUEUE, attempt=AttemptState(att.state)))
            apply_transitions(session=session, resolution=done, run=run, attempt=att, notes=note)
    done = resolve(Situation(Happening.CANCELLED_IN_QUEUE, run=RunState(run.state)))
    apply_transitions(session=session, resolution=done, run=run, notes=note)


def request_cancel(*, session: Session, run: Run, by: str) -> Run:
    """Cancel a run: a queued one at once; an active one by flagging it for the scheduler to stop.

    A finished run cannot be cancelled (IllegalTransition, a 409 at the API).
    """
    state = RunState(run.state)
    if state is RunState.queued:
        cancel_queued_run(session=session, run=run, reason=f"cancelled by {by}")
    elif state in TERMINAL_RUN_STATES:
        raise IllegalTransition("run", state.value, RunState.cancelled.value)
    elif not run.cancel_requested:
        run.cancel_requested = True
        run.updated_at = utcnow()
        session.flush()
    return run


def request_retry(
    *,
    session: Session,
    run: Run,
    by: str,
    overrides: Mapping[str, Any] | None = None,
) -> Attempt:
    """Re-queue a failed or cancelled run with a new ``pending`` attempt of kind ``manual``.

    The new attempt inherits the previous attempt's overrides (the settings it had tightened to) with the
    caller's ``{"path": new_value}`` on top, stored as ``{"path": [recipe_value, new_value]}`` and validated
    against the recipe schema (RecipeError naming the path). It resumes where the recovery policy says a
    manual retry resumes (``manual_retry_checkpoint``: the newest valid, healthy checkpoint in the lineage of
    the last ended attempt), if there is one. Other states raise IllegalTransition (409).
    """
    check_run_transition(run.state, RunState.queued)
    parsed = run.recipe.parsed
    recipe = Recipe.model_validate(parsed, context={"allowed_import_modules": admitted_modules(parsed)})
    base_doc = recipe_to_dict(recipe)
    previous = max(run.attempts, key=lambda a: a.number, default=None)
    merged: dict[str, Any] = {}
    if previous is not None:
        merged.update({k: _override_new(v) for k, v in previous.overrides.items()})
    for path, value in (overrides or {}).items():
        merged[path] = _override_new(value)
    effective = apply_overrides(recipe, merged)
    diff = {path: [get_path(base_doc, path), get_path(recipe_to_dict(effective), path)] for path in merged}
    resume = manual_retry_checkpoint(run_history(run), run_checkpoints(session, run))
    plan: dict[str, Any] = {"rewarm_steps": 0, "data_offset": 0, "resume_uri": None}
    if resume is not None:
        plan = {"rewarm_steps": effective.recovery.rewarm_steps, "data_offset": 0, "resume_uri": resume.uri}
    number = (previous.number if previous is not None else 0) + 1
    reason = f"manual retry by {by}"
    attempt = Attempt(
        run_id=run.id,
        number=number,
        state=AttemptState.pending.value,
        kind=MANUAL_RETRY_KIND,
        parent_checkpoint_id=resume.id if resume is not None else None,
        resume_step=resume.step if resume is not None else 0,
        overrides=diff,
        plan=plan,
        reason=reason,
    )
    session.add(attempt)
    session.flush()
    run.cancel_requested = False
    run.current_attempt = number
    queued = resolve(Situation(Happening.RETRY_REQUESTED, run=RunState(run.state)))
    apply_transitions(session=session, resolution=queued, run=run, next_attempt=attempt,
                      notes={Why.EVENT: Note(reason, {"attempt": number, "overrides": diff})})
    return attempt


def _override_new(change: Any) -> Any:
    """``[old, new]`` (the stored form) → new; a bare value is already the new value."""
    if isinstance(change, list | tuple) and len(change) == 2:
        return change[1]
    return change


