"""Engine and session setup. SQLite gets WAL mode, a busy timeout and enforced foreign keys; a PostgreSQL pool
pings a connection before handing it out only when it has sat idle (``PING_IDLE_S``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import event
from sqlalchemy.orm import Session, sessionmaker


def make_engine(url: str, **kwargs: Any) -> sa.Engine:
    """Create an engine for a SQLite or PostgreSQL URL (creating the SQLite file's directory)."""
    if url.startswith("sqlite"):
        path = sa.engine.make_url(url).database
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(url, connect_args={"check_same_thread": False, "timeout": 30}, **kwargs)

        @event.listens_for(engine, "connect")
        def _sqlite_pragmas(dbapi_conn: Any, _record: Any) -> None:
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")
            cur.execute("PRAGMA foreign_keys=ON")
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    ping_when_idle = "pool_pre_ping" not in kwargs
    if "poolclass" not in kwargs:  # sizing only applies to the default QueuePool (not e.g. NullPool)
        kwargs.setdefault("pool_size", 20)
        kwargs.setdefault("max_overflow", 20)
        kwargs.setdefault("pool_use_lifo", True)  # the busy connections stay busy, the rest go idle (and get pinged)
    engine = sa.create_engine(url, **kwargs)
    if ping_when_idle:
        _ping_when_idle(engine)
    return engine


PING_IDLE_S = 1.0
"""A pooled connection idle for longer than this is pinged when it is checked out again (a dead one is replaced).

SQLAlchemy's ``pool_pre_ping`` pings at *every* checkout: a round trip per request or scheduler transaction, which
was ~15-25 % of a ``GET /runs/{id}``'s server CPU and half its round trips. A connection that was in use a moment
ago is alive unless the server went away in that moment; then the statement fails, SQLAlchemy recognises the
disconnect and invalidates the whole pool, so only what was in flight at the restart fails, as it would anyway.
A connection that sat idle (a quiet API, a database restarted overnight) is pinged first, as before."""


def _ping_when_idle(engine: sa.Engine) -> None:
    @event.listens_for(engine, "checkin")
    def _returned(_dbapi_conn: Any, record: Any) -> None:
        if record is not None:
            record.info["returned_at"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _ping(dbapi_conn: Any, record: Any, _proxy: Any) -> None:
        returned = record.info.get("returned_at")
        if returned is None or time.monotonic() - returned <= PING_IDLE_S:
            return  # just connected, or in use a moment ago
        try:
            alive = engine.dialect.do_ping(dbapi_conn)
        except Exception as exc:  # noqa: BLE001 - any failure to ping means: replace the connection
            raise sa.exc.DisconnectionError(f"the pooled connection is gone: {exc}") from exc
        if not alive:
            raise sa.exc.DisconnectionError("the pooled connection is gone")


def make_session_factory(engine: sa.Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def transaction(factory: sessionmaker[Session]) -> Iterator[Session]:
    """A session whose work commits on success and rolls back on error (the caller owns the transaction)."""
    with factory() as session, session.begin():
        yield session
