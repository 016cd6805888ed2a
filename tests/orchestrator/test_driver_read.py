"""``DriverRead``: a fixed statement run on the pooled DBAPI connection (or, on PostgreSQL, on the event loop through
``AsyncReadPool``) gives the rows SQLAlchemy would give (values and Python types, JSON decoded, timestamps
timezone-aware), and leaves the connection as it found it."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.store import repo
from orchestrator.store.db import AsyncReadPool, DriverRead
from orchestrator.store.models import AnomalyRow, Attempt, Run
from orchestrator.store.runs import _overview_statement
from tests.aio import run_coroutine
from tests.api.conftest import seed_attempt, seed_run


def _busy_run(factory: sessionmaker[Session]) -> int:
    """A run with every overview column filled: two attempts (JSON overrides, plan and outcome, timestamps),
    anomalies of two kinds, a NULL-able float and text set."""
    run_id = seed_run(factory, owner="alice", state="recovering")
    first = seed_attempt(factory, run_id, 1, state="diverged")
    seed_attempt(factory, run_id, 2, state="running", kind="numeric_retry",
                 overrides={"optimizer.lr": [0.003, 0.0015], "clipping.max_norm": [None, 1.0]})
    with factory() as s:
        for seq, kind in enumerate(["loss_spike", "grad_norm_spike", "loss_spike"], start=1):
            s.add(AnomalyRow(run_id=run_id, attempt_id=first, seq=seq, step=40 + seq, kind=kind, detector=kind,
                             value=float("inf") if seq == 2 else 10.5, threshold=6.0, action="rollback",
                             details={"onset": 39, "why": "ünïcode"}))
        att = s.scalars(sa.select(Attempt).where(Attempt.run_id == run_id, Attempt.number == 2)).one()
        att.plan = {"rule": "lr_cut", "lr_probe": {"candidates": [0.0015, 0.000375]}}
        att.outcome = {"verdict": None, "losses": [1.5, 2.25]}
        att.started_at = datetime(2026, 12, 3, 11, 0, 0, 123456, tzinfo=UTC)
        att.resume_step, att.onset_step, att.last_step = 30, 41, 57
        run = s.get(Run, run_id)
        assert run is not None
        run.best_loss, run.last_step, run.retries_used, run.reason = 2.5, 57, 1, "loss spike at step 43"
        run.started_at = datetime(2026, 12, 3, 10, 59, tzinfo=UTC)
        s.commit()
    return run_id


def _typed(rows: list[Any]) -> list[list[tuple[type, Any]]]:
    return [[(type(v), v) for v in row] for row in rows]


def _async_rows(engine: sa.Engine, read: DriverRead, params: dict[str, Any]) -> list[tuple[Any, ...]] | None:
    """``read.arows`` on a fresh ``AsyncReadPool`` of ``engine``; None where there is no such pool (SQLite)."""
    pool = AsyncReadPool.for_engine(engine, 1)
    if pool is None:
        return None

    async def go() -> list[tuple[Any, ...]]:
        try:
            return await read.arows(pool, params)
        finally:
            await pool.close()

    return run_coroutine(go)


@pytest.mark.parametrize("by_owner", [False, True])
def test_rows_match_what_sqlalchemy_returns(
    engine: sa.Engine, session_factory: sessionmaker[Session], by_owner: bool
) -> None:
    run_id = _busy_run(session_factory)
    stmt = _overview_statement(by_owner)
    params: dict[str, Any] = {"run_id": run_id, **({"owner": "alice"} if by_owner else {})}
    with session_factory() as s:
        expected = [tuple(r) for r in s.execute(stmt, params).all()]
    read = DriverRead(stmt)
    got = read.rows(engine, params)
    assert len(expected) == 2  # one row per anomaly kind
    assert _typed(got) == _typed(expected)
    assert read.rows(engine, params) == got  # the processors worked out on the first read are reused
    on_the_loop = _async_rows(engine, DriverRead(stmt), params)
    assert (on_the_loop is None) == (engine.dialect.name == "sqlite")
    if on_the_loop is not None:
        assert _typed(on_the_loop) == _typed(expected)
    assert read.keys == tuple(stmt.selected_columns.keys())
    first = dict(zip(read.keys, got[0], strict=True))
    assert first["attempt_started_at"] == datetime(2026, 12, 3, 11, 0, 0, 123456, tzinfo=UTC)
    assert first["attempt_plan"]["lr_probe"] == {"candidates": [0.0015, 0.000375]}


def test_overview_of_a_run_someone_else_owns_is_none(session_factory: sessionmaker[Session]) -> None:
    run_id = _busy_run(session_factory)
    with session_factory() as s:
        assert repo.get_run_overview(session=s, run_id=run_id, owner="bob") is None
        assert repo.get_run_overview(session=s, run_id=run_id + 1) is None
        found = repo.get_run_overview(session=s, run_id=run_id, owner="alice")
    assert found is not None
    assert found.anomalies_by_kind == {"grad_norm_spike": 1, "loss_spike": 2}
    assert found.attempt is not None and found.attempt["number"] == 2
    assert found.run["reason"] == "loss spike at step 43"


def test_the_connection_goes_back_to_the_pool_transactional(
    engine: sa.Engine, session_factory: sessionmaker[Session]
) -> None:
    """The read runs in autocommit; a later user of the same pooled connection gets transactions again (a write it
    rolls back is gone)."""
    run_id = _busy_run(session_factory)
    read = DriverRead(_overview_statement(False))
    assert read.rows(engine, {"run_id": run_id})
    with engine.connect() as conn:
        conn.execute(sa.update(Run).where(Run.id == run_id).values(reason="not kept"))
        conn.rollback()
    with session_factory() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.reason == "loss spike at step 43"


_text = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=30)
_floats = st.floats(allow_nan=False, allow_infinity=False, width=32) | st.none()
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | _floats | _text,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
    max_leaves=8,
)
_times = st.datetimes(min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC))


@given(
    reason=_text | st.none(), best_loss=_floats, last_step=st.integers(0, 2**31 - 1) | st.none(),
    started_at=_times | st.none(), plan=st.dictionaries(_text, _json, max_size=4), outcome=_json,
    overrides=st.dictionaries(_text, st.lists(_json, min_size=2, max_size=2), max_size=3),
    kinds=st.lists(st.sampled_from(["loss_spike", "nonfinite", "grad_norm_spike", "stalled"]), max_size=6),
    attempts=st.integers(0, 3),
)
@settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_any_run_reads_back_as_sqlalchemy_reads_it(
    engine: sa.Engine, session_factory: sessionmaker[Session], reason: str | None, best_loss: float | None,
    last_step: int | None, started_at: datetime | None, plan: dict[str, Any], outcome: Any,
    overrides: dict[str, Any], kinds: list[str], attempts: int,
) -> None:
    """Whatever a run holds (text, NULLs, JSON of any shape, timestamps), the driver read gives what SQLAlchemy's
    execution of the same statement gives, value and Python type (seeded: the suite's hypothesis profile)."""
    run_id = seed_run(session_factory, owner="alice")
    with session_factory() as s:
        ids = []
        for number in range(1, attempts + 1):
            att = Attempt(run_id=run_id, number=number, state="running", overrides=overrides, plan=plan,
                          outcome=outcome, started_at=started_at)
            s.add(att)
            s.flush()
            ids.append(att.id)
        for seq, kind in enumerate(kinds if ids else [], start=1):
            s.add(AnomalyRow(run_id=run_id, attempt_id=ids[-1], seq=seq, step=seq, kind=kind, detector=kind,
                             value=best_loss, threshold=None, action="record"))
        run = s.get(Run, run_id)
        assert run is not None
        run.reason, run.best_loss, run.last_step, run.started_at = reason, best_loss, last_step, started_at
        run.current_attempt = attempts
        s.commit()
    stmt = _overview_statement(True)
    params = {"run_id": run_id, "owner": "alice"}
    with session_factory() as s:
        expected = [tuple(r) for r in s.execute(stmt, params).all()]
    assert _typed(DriverRead(stmt).rows(engine, params)) == _typed(expected)
    on_the_loop = _async_rows(engine, DriverRead(stmt), params)
    assert on_the_loop is None or _typed(on_the_loop) == _typed(expected)
