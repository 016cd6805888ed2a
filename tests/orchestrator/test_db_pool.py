"""The PostgreSQL pools' liveness check (the engine's, and the API's ``AsyncReadPool``): a connection that sat idle
is pinged (and replaced when its server side is gone) before it is handed out; one in use a moment ago is handed out
without a round trip, and if its server went away the read fails once, as SQLAlchemy's error, and the next one
connects afresh."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator

import pytest
import sqlalchemy as sa

import orchestrator.store.db as db
from tests.aio import run_coroutine
from tests.conftest import create_pg_database, drop_pg_database

pytestmark = pytest.mark.postgres


@pytest.fixture
def pg_url() -> Iterator[str]:
    url = create_pg_database("ballast_pool")
    try:
        yield url
    finally:
        drop_pg_database(url)


def _kill_backend(url: str, pid: int) -> None:
    admin = sa.create_engine(url, poolclass=sa.pool.NullPool)
    with admin.connect() as conn:
        conn.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pid})
    admin.dispose()


def test_a_connection_in_use_a_moment_ago_is_not_pinged(pg_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(db, "PING_IDLE_S", 3600.0)
    engine = db.make_engine(pg_url)
    pings: list[object] = []
    real = engine.dialect.do_ping
    monkeypatch.setattr(engine.dialect, "do_ping", lambda c: pings.append(c) or real(c))
    for _ in range(3):
        with engine.connect() as conn:
            assert conn.scalar(sa.text("SELECT 1")) == 1
    assert pings == []
    engine.dispose()


def test_an_idle_connection_whose_server_side_is_gone_is_replaced(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db, "PING_IDLE_S", 0.0)  # every returned connection counts as idle
    engine = db.make_engine(pg_url)
    with engine.connect() as conn:
        pid = conn.scalar(sa.text("SELECT pg_backend_pid()"))
    _kill_backend(pg_url, int(pid or 0))
    with engine.connect() as conn:  # pinged, found dead, replaced: the caller never sees the dead connection
        assert conn.scalar(sa.text("SELECT pg_backend_pid()")) != pid
    engine.dispose()


def test_a_busy_connection_whose_server_went_away_fails_once_then_the_pool_recovers(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not pinged (in use a moment ago): the statement fails as a disconnect, which invalidates the pool, and the
    next checkout connects afresh."""
    monkeypatch.setattr(db, "PING_IDLE_S", 3600.0)
    engine = db.make_engine(pg_url)
    with engine.connect() as conn:
        pid = conn.scalar(sa.text("SELECT pg_backend_pid()"))
    _kill_backend(pg_url, int(pid or 0))
    with pytest.raises(sa.exc.OperationalError) as failed, engine.connect() as conn:
        conn.scalar(sa.text("SELECT 1"))
    assert failed.value.connection_invalidated
    with engine.connect() as conn:
        assert conn.scalar(sa.text("SELECT 1")) == 1
    engine.dispose()


def test_a_driver_read_whose_server_went_away_fails_as_sqlalchemy_would_then_the_pool_recovers(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``DriverRead`` bypasses SQLAlchemy's execution: a dead connection still surfaces as SQLAlchemy's
    OperationalError (the API's 503), is not handed out again, and the next read connects afresh."""
    monkeypatch.setattr(db, "PING_IDLE_S", 3600.0)
    engine = db.make_engine(pg_url)
    read = db.DriverRead(sa.select(sa.func.pg_backend_pid().label("pid")))
    [(pid,)] = read.rows(engine, {})
    _kill_backend(pg_url, int(pid))
    with pytest.raises(sa.exc.OperationalError) as failed:
        read.rows(engine, {})
    assert failed.value.connection_invalidated
    [(fresh,)] = read.rows(engine, {})
    assert fresh != pid
    engine.dispose()


_PID = db.DriverRead(sa.select(sa.func.pg_backend_pid().label("pid")))


def _with_read_pool(url: str, scenario: Callable[[db.AsyncReadPool], Awaitable[None]]) -> None:
    engine = db.make_engine(url)
    pool = db.AsyncReadPool.for_engine(engine, 1)
    assert pool is not None
    pool.timeout = 0.5

    async def go() -> None:
        try:
            await scenario(pool)
        finally:
            await pool.close()

    run_coroutine(go)
    engine.dispose()


def test_an_async_read_whose_server_went_away_fails_once_then_the_pool_recovers(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db, "PING_IDLE_S", 3600.0)  # in use a moment ago: not pinged

    async def scenario(pool: db.AsyncReadPool) -> None:
        [(pid,)] = await _PID.arows(pool, {})
        _kill_backend(pg_url, int(pid))
        with pytest.raises(sa.exc.OperationalError):  # the API's 503
            await _PID.arows(pool, {})
        [(fresh,)] = await _PID.arows(pool, {})
        assert fresh != pid

    _with_read_pool(pg_url, scenario)


def test_an_idle_async_read_connection_whose_server_side_is_gone_is_replaced(
    pg_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(db, "PING_IDLE_S", 0.0)  # every returned connection counts as idle

    async def scenario(pool: db.AsyncReadPool) -> None:
        [(pid,)] = await _PID.arows(pool, {})
        _kill_backend(pg_url, int(pid))
        [(fresh,)] = await _PID.arows(pool, {})  # pinged, found dead, replaced: the caller never sees it
        assert fresh != pid

    _with_read_pool(pg_url, scenario)


def test_a_read_that_finds_every_connection_busy_past_the_timeout_is_a_database_error(pg_url: str) -> None:
    """The pool's size bounds the connections; a read that waits past the timeout fails as an OperationalError
    (the API's 503) and takes nothing from the holder, whose connection serves the next read."""

    async def scenario(pool: db.AsyncReadPool) -> None:
        async with pool.connection() as held:
            with pytest.raises(sa.exc.OperationalError, match="no database connection free"):
                await _PID.arows(pool, {})
            pid = held.info.backend_pid
        [(again,)] = await _PID.arows(pool, {})
        assert again == pid

    _with_read_pool(pg_url, scenario)


def test_a_read_that_fails_closes_its_connection_and_the_next_one_connects_afresh(pg_url: str) -> None:
    """A connection whose user raised is not handed out again (its state is unknown, e.g. a query cancelled midway)."""
    bad = db.DriverRead(sa.select(sa.literal_column("1 / (pg_backend_pid() - pg_backend_pid())").label("x")))

    async def scenario(pool: db.AsyncReadPool) -> None:
        [(pid,)] = await _PID.arows(pool, {})
        with pytest.raises(sa.exc.DataError):  # division by zero, raised by the server
            await bad.arows(pool, {})
        [(fresh,)] = await _PID.arows(pool, {})
        assert fresh != pid

    _with_read_pool(pg_url, scenario)
