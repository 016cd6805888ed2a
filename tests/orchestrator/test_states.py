"""Run and attempt state machines: the transition tables, and every change through the store on both backends.

The expected tables are written out here on purpose (not read from ``orchestrator.policy.states``): they are the
contract the scheduler, recovery and API rely on, so changing one must be a visible edit to this file too.
"""

from __future__ import annotations

import itertools
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.policy.states import (
    ACTIVE_RUN_STATES,
    TERMINAL_ATTEMPT_STATES,
    TERMINAL_RUN_STATES,
    AttemptState,
    IllegalTransition,
    RunState,
    check_attempt_transition,
    check_run_transition,
)
from orchestrator.store.models import Attempt, Event, RecipeRow, Run
from orchestrator.store.repo import set_attempt_state, set_run_state

R, A = RunState, AttemptState

LEGAL_RUN = {
    (R.queued, R.starting), (R.queued, R.cancelled),
    (R.starting, R.running), (R.starting, R.failed), (R.starting, R.cancelled), (R.starting, R.queued),
    (R.running, R.recovering), (R.running, R.succeeded), (R.running, R.failed), (R.running, R.cancelled),
    (R.recovering, R.starting), (R.recovering, R.running), (R.recovering, R.failed), (R.recovering, R.cancelled),
    (R.failed, R.queued), (R.cancelled, R.queued),
}  # fmt: skip
LEGAL_ATTEMPT = {
    (A.pending, A.running), (A.pending, A.crashed), (A.pending, A.cancelled), (A.pending, A.config_error),
    (A.running, A.succeeded), (A.running, A.diverged), (A.running, A.crashed), (A.running, A.cancelled),
    (A.running, A.config_error),
}  # fmt: skip
ALL_RUN = list(itertools.product(RunState, RunState))
ALL_ATTEMPT = list(itertools.product(AttemptState, AttemptState))


def _id(pair: tuple[object, object]) -> str:
    return f"{pair[0]}->{pair[1]}"


# ------------------------------------------------------------------------------------------- pure tables
def test_state_sets() -> None:
    assert [s.value for s in RunState] == [
        "queued", "starting", "running", "recovering", "succeeded", "failed", "cancelled"
    ]
    assert [s.value for s in AttemptState] == [
        "pending", "running", "succeeded", "diverged", "crashed", "cancelled", "config_error"
    ]
    assert TERMINAL_RUN_STATES == {R.succeeded, R.failed, R.cancelled}
    assert ACTIVE_RUN_STATES == {R.starting, R.running, R.recovering}
    assert TERMINAL_ATTEMPT_STATES == {A.succeeded, A.diverged, A.crashed, A.cancelled, A.config_error}


@pytest.mark.parametrize("pair", ALL_RUN, ids=[_id(p) for p in ALL_RUN])
def test_run_transition_table(pair: tuple[RunState, RunState]) -> None:
    current, target = pair
    if pair in LEGAL_RUN:
        check_run_transition(current, target)
        check_run_transition(current.value, target.value)  # plain strings, as stored in the database
    else:
        with pytest.raises(IllegalTransition) as info:
            check_run_transition(current, target)
        assert (info.value.entity, info.value.current, info.value.target) == ("run", current.value, target.value)
        assert str(info.value) == f"illegal run transition {current.value} -> {target.value}"


@pytest.mark.parametrize("pair", ALL_ATTEMPT, ids=[_id(p) for p in ALL_ATTEMPT])
def test_attempt_transition_table(pair: tuple[AttemptState, AttemptState]) -> None:
    current, target = pair
    if pair in LEGAL_ATTEMPT:
        check_attempt_transition(current, target)
        check_attempt_transition(current.value, target.value)
    else:
        with pytest.raises(IllegalTransition) as info:
            check_attempt_transition(current, target)
        assert (info.value.entity, info.value.current, info.value.target) == ("attempt", current.value, target.value)


def test_unknown_state_names_are_rejected() -> None:
    with pytest.raises(ValueError):
        check_run_transition("queued", "exploded")
    with pytest.raises(ValueError):
        check_attempt_transition("paused", "running")


def test_succeeded_is_final_and_every_state_is_reachable_from_queued() -> None:
    reachable, frontier = {R.queued}, [R.queued]
    while frontier:
        cur = frontier.pop()
        for a, b in LEGAL_RUN:
            if a is cur and b not in reachable:
                reachable.add(b)
                frontier.append(b)
    assert reachable == set(RunState)
    assert not [b for a, b in LEGAL_RUN if a is R.succeeded]


# ------------------------------------------------------------------------------------------ via the store
def _make_run(session: Session, state: RunState) -> Run:
    recipe = RecipeRow(name="r", owner="alice", content_hash="0" * 64, text="name: r\n", parsed={"name": "r"})
    session.add(recipe)
    session.flush()
    run = Run(recipe_id=recipe.id, name="r", owner="alice", state=state.value)
    session.add(run)
    session.flush()
    return run


def _events(factory: sessionmaker[Session]) -> list[Event]:
    with factory() as s:
        return list(s.scalars(sa.select(Event).order_by(Event.id)))


@pytest.mark.parametrize("current", list(RunState), ids=[s.value for s in RunState])
def test_set_run_state_checks_and_logs_every_transition(
    session_factory: sessionmaker[Session], current: RunState
) -> None:
    for target in RunState:
        with session_factory() as session, session.begin():
            run = _make_run(session, current)
            run_id = run.id
            if current in TERMINAL_RUN_STATES:
                run.ended_at = datetime(2020, 1, 1, tzinfo=UTC)
            before = {e.id for e in _events(session_factory)}
            if (current, target) not in LEGAL_RUN:
                with pytest.raises(IllegalTransition):
                    set_run_state(session=session, run=run, to=target, reason="nope")
                assert run.state == current.value
                continue
            ev = set_run_state(session=session, run=run, to=target, reason=f"because {target}", data={"k": 1})
            assert ev.id is not None  # flushed by the repo function
        with session_factory() as s:
            stored = s.get_one(Run, run_id)
            new = [e for e in _events(session_factory) if e.id not in before and e.run_id == run_id]
            assert stored.state == target.value, (current, target)
            assert len(new) == 1, (current, target)
            e = new[0]
            assert (e.entity, e.attempt_id, e.from_state, e.to_state) == ("run", None, current.value, target.value)
            assert (e.reason, e.data) == (f"because {target}", {"k": 1})
            assert stored.reason == f"because {target}"
            assert e.created_at.tzinfo is not None
            if target in TERMINAL_RUN_STATES:
                assert stored.ended_at is not None and stored.ended_at.year > 2020
            else:
                assert stored.ended_at is None, (current, target)  # a re-queued run is no longer ended
            if target is R.starting:
                assert stored.started_at is not None
    # illegal attempts left no trace in the log
    with session_factory() as s:
        logged = {(e.from_state, e.to_state) for e in s.scalars(sa.select(Event))}
        assert logged == {(current.value, t.value) for t in RunState if (current, t) in LEGAL_RUN}


@pytest.mark.parametrize("current", list(AttemptState), ids=[s.value for s in AttemptState])
def test_set_attempt_state_checks_and_logs_every_transition(
    session_factory: sessionmaker[Session], current: AttemptState
) -> None:
    for number, target in enumerate(AttemptState, start=1):
        with session_factory() as session, session.begin():
            run = _make_run(session, R.running)
            attempt = Attempt(run_id=run.id, number=number, state=current.value)
            session.add(attempt)
            session.flush()
            run_id, attempt_id = run.id, attempt.id
            if (current, target) not in LEGAL_ATTEMPT:
                with pytest.raises(IllegalTransition):
                    set_attempt_state(session=session, attempt=attempt, to=target)
                assert attempt.state == current.value
                continue
            set_attempt_state(session=session, attempt=attempt, to=target, reason="detector: loss_spike")
        with session_factory() as s:
            stored = s.get_one(Attempt, attempt_id)
            [e] = [e for e in _events(session_factory) if e.attempt_id == attempt_id]
            assert stored.state == target.value
            assert (e.entity, e.run_id, e.from_state, e.to_state, e.reason) == (
                "attempt", run_id, current.value, target.value, "detector: loss_spike"
            )
            assert (stored.ended_at is not None) == (target in TERMINAL_ATTEMPT_STATES)
            assert (stored.started_at is not None) == (target is A.running)
    with session_factory() as s:
        logged = {(e.from_state, e.to_state) for e in s.scalars(sa.select(Event))}
        assert logged == {(current.value, t.value) for t in AttemptState if (current, t) in LEGAL_ATTEMPT}


def test_a_whole_run_leaves_an_ordered_audit_trail(session_factory: sessionmaker[Session]) -> None:
    """queued → … → succeeded with a diverged first attempt: the log replays the story in order."""
    with session_factory() as session, session.begin():
        run = _make_run(session, R.queued)
        first = Attempt(run_id=run.id, number=1, state=A.pending.value)
        session.add(first)
        session.flush()
        set_run_state(session=session, run=run, to=R.starting)
        set_attempt_state(session=session, attempt=first, to=A.running)
        set_run_state(session=session, run=run, to=R.running)
        set_attempt_state(session=session, attempt=first, to=A.diverged, reason="loss spike at 120")
        set_run_state(session=session, run=run, to=R.recovering)
        second = Attempt(run_id=run.id, number=2, state=A.pending.value)
        session.add(second)
        session.flush()
        set_attempt_state(session=session, attempt=second, to=A.running)
        set_run_state(session=session, run=run, to=R.running)
        set_attempt_state(session=session, attempt=second, to=A.succeeded)
        set_run_state(session=session, run=run, to=R.succeeded)
        with pytest.raises(IllegalTransition):
            set_run_state(session=session, run=run, to=R.running)
        run_id = run.id
    trail = [(e.entity, e.from_state, e.to_state) for e in _events(session_factory) if e.run_id == run_id]
    assert trail == [
        ("run", "queued", "starting"),
        ("attempt", "pending", "running"),
        ("run", "starting", "running"),
        ("attempt", "running", "diverged"),
        ("run", "running", "recovering"),
        ("attempt", "pending", "running"),
        ("run", "recovering", "running"),
        ("attempt", "running", "succeeded"),
        ("run", "running", "succeeded"),
    ]
