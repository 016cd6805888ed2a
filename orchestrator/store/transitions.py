"""State changes and the audit log: the only way a run's or an attempt's state changes.

``set_run_state`` / ``set_attempt_state`` check the transition table (``orchestrator.policy.states``) and write
an ``Event`` row; ``apply_transitions`` applies what the rules (``orchestrator.policy.rules``) resolved, hop by
hop, through them. Keyword arguments, ``add``/``flush`` only: the caller owns the transaction.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any, cast

import sqlalchemy as sa
from sqlalchemy.orm import Session

from orchestrator.policy.rules import FIXED_NOTES, Entity, Note, Resolution, Why
from orchestrator.policy.states import (
    TERMINAL_ATTEMPT_STATES,
    TERMINAL_RUN_STATES,
    AttemptState,
    FailureKind,
    RunState,
    check_attempt_transition,
    check_run_transition,
)
from orchestrator.store.models import Attempt, Event, Run, utcnow


def set_run_state(
    *, session: Session, run: Run, to: RunState, reason: str | None = None, data: dict[str, Any] | None = None,
    failure: FailureKind | None = None,
) -> Event:
    """Move a run to ``to`` (raises IllegalTransition) and log it; a move to ``failed`` records ``failure`` (its
    kind, also in the log's data), any other move clears it."""
    check_run_transition(run.state, to)
    if to is RunState.failed and failure is not None:
        data = {**(data or {}), "failure_kind": failure.value}
    run.failure_kind = failure.value if to is RunState.failed and failure is not None else None
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


def apply_transitions(
    *,
    session: Session,
    resolution: Resolution,
    run: Run,
    notes: Mapping[Why, Note],
    attempt: Attempt | None = None,
    next_attempt: Attempt | None = None,
) -> None:
    """Apply ``resolution``'s hops in order: ``run``, the ``attempt`` concerned, the ``next_attempt`` (already
    recorded, pending, by the caller: its ``NEXT → pending`` hop only checks that). ``notes`` gives the words
    for each role (``FIXED_NOTES`` fill in the fixed ones). A hop that fails the run records the resolution's
    ``failure`` kind."""
    for hop in resolution.hops:
        note = notes.get(hop.why) or FIXED_NOTES[hop.why]
        if hop.entity is Entity.RUN:
            set_run_state(session=session, run=run, to=RunState(hop.to), reason=note.reason, data=note.data,
                          failure=resolution.failure)
            continue
        target = attempt if hop.entity is Entity.ATTEMPT else next_attempt
        if target is None:
            raise ValueError(f"rules {resolution.rules}: a {hop.entity.value} hop without that attempt")
        if hop.entity is Entity.NEXT and hop.to is AttemptState.pending:
            if target.state != AttemptState.pending.value:
                raise ValueError(f"rules {resolution.rules}: the next attempt is {target.state}, not pending")
            continue
        set_attempt_state(session=session, attempt=target, to=AttemptState(hop.to), reason=note.reason,
                          data=note.data)


_INSERT_EVENT = sa.insert(cast(sa.Table, Event.__table__))
"""A Core insert of one audit-log row, for writers that do not need the ``Event`` object back."""


def log_creation(*, session: Session, run: Run, owner: str, now: datetime) -> None:
    """The audit-log row of a new run. Creation is not a transition (there is no "from" state), but it belongs in
    the log all the same; a Core insert, since nothing needs the Event object (an ORM flush of it costs several
    times more CPU on the submission hot path)."""
    session.execute(_INSERT_EVENT, {"run_id": run.id, "attempt_id": None, "entity": "run", "from_state": None,
                                    "to_state": run.state, "reason": "submitted", "data": {"owner": owner},
                                    "created_at": now})
