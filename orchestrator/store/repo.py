"""Data-access functions. They take keyword arguments, only ``add``/``flush``; the caller owns the transaction.

State changes of runs and attempts go through ``set_run_state`` / ``set_attempt_state`` only: each checks the
transition table in ``orchestrator.states`` and writes an ``Event``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session

from orchestrator.states import (
    TERMINAL_ATTEMPT_STATES,
    TERMINAL_RUN_STATES,
    AttemptState,
    RunState,
    check_attempt_transition,
    check_run_transition,
)
from orchestrator.store.models import Attempt, Event, Run, utcnow


def set_run_state(
    *, session: Session, run: Run, to: RunState, reason: str | None = None, data: dict[str, Any] | None = None
) -> Event:
    """Move a run to ``to`` (raises IllegalTransition) and log it."""
    check_run_transition(run.state, to)
    ev = Event(
        run_id=run.id, entity="run", from_state=run.state, to_state=to.value, reason=reason, data=data or {}
    )
    now = utcnow()
    if to is RunState.starting and run.started_at is None:
        run.started_at = now
    if to in TERMINAL_RUN_STATES:
        run.ended_at = now
    elif run.ended_at is not None:
        run.ended_at = None
    run.state = to.value
    if reason is not None:
        run.reason = reason
    run.updated_at = now
    session.add(ev)
    session.flush()
    return ev


def set_attempt_state(
    *,
    session: Session,
    attempt: Attempt,
    to: AttemptState,
    reason: str | None = None,
    data: dict[str, Any] | None = None,
) -> Event:
    """Move an attempt to ``to`` (raises IllegalTransition) and log it."""
    check_attempt_transition(attempt.state, to)
    ev = Event(
        run_id=attempt.run_id,
        attempt_id=attempt.id,
        entity="attempt",
        from_state=attempt.state,
        to_state=to.value,
        reason=reason,
        data=data or {},
    )
    now = utcnow()
    if to is AttemptState.running and attempt.started_at is None:
        attempt.started_at = now
    if to in TERMINAL_ATTEMPT_STATES:
        attempt.ended_at = now
    attempt.state = to.value
    session.add(ev)
    session.flush()
    return ev
