"""Engine and session setup. SQLite gets WAL mode, a busy timeout and enforced foreign keys; a PostgreSQL pool
pings a connection before handing it out only when it has sat idle (``PING_IDLE_S``)."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
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


class DriverRead:
    """A fixed SELECT run on the pooled DBAPI connection itself, compiled once per dialect.

    For the hottest reads only (``GET /runs/{id}``): going through a Session and SQLAlchemy's result machinery
    cost ~0.6 ms of CPU per execution on top of the driver's ~0.25 ms, most of it per-execution set-up that a
    fixed statement does not need (the session's transaction bookkeeping, the result metadata built from the
    cursor's description, which psycopg creates anew per column per execution). Rows come back as tuples in the
    statement's column order, each value through its column type's result processor, as SQLAlchemy would give
    them. The read runs in autocommit (one statement sees one snapshot; no BEGIN/ROLLBACK round trips). What it
    gives up: SQLAlchemy's statement events and ``echo`` logging do not see it.
    """

    def __init__(self, stmt: sa.Select[Any]) -> None:
        self.stmt = stmt
        self.keys = tuple(stmt.selected_columns.keys())
        self._compiled: weakref.WeakKeyDictionary[sa.Dialect, _Compiled] = weakref.WeakKeyDictionary()

    def rows(self, engine: sa.Engine, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        dialect = engine.dialect
        compiled = self._compiled_for(dialect)
        bound = compiled.bind(params)
        conn = engine.raw_connection()
        try:
            raw = self._execute(conn, dialect, compiled, bound)
        except dialect.loaded_dbapi.Error as exc:
            # as SQLAlchemy's own execution would: this connection is dropped (the next checkout of the others
            # pings them if idle), and the error is SQLAlchemy's (OperationalError: the API's 503)
            conn.invalidate(exc)
            raise _as_sqlalchemy_error(exc, compiled, bound, dialect) from exc
        except BaseException:
            conn.invalidate()  # a connection in an unknown state is not handed out again
            raise
        finally:
            conn.close()
        return compiled.process(raw)

    async def arows(self, pool: AsyncReadPool, params: Mapping[str, Any]) -> list[tuple[Any, ...]]:
        """``rows`` on the event loop, on a connection of ``pool``: no worker-thread hop."""
        compiled = self._compiled_for(pool.dialect)
        bound = compiled.bind(params)
        try:
            async with pool.connection() as conn:
                cursor = await conn.execute(compiled.sql, bound)
                if compiled.processors is None:
                    compiled.processors = _processors(self.stmt, pool.dialect, cursor.description or ())
                raw = await cursor.fetchall()
        except psycopg.Error as exc:  # a broken connection is discarded by the pool when it comes back
            raise _as_sqlalchemy_error(exc, compiled, bound, pool.dialect) from exc
        return compiled.process(raw)

    def _compiled_for(self, dialect: sa.Dialect) -> _Compiled:
        compiled = self._compiled.get(dialect)
        if compiled is None:
            compiled = self._compiled[dialect] = _Compiled.of(self.stmt, dialect)
        return compiled

    def _execute(self, conn: Any, dialect: sa.Dialect, compiled: _Compiled, bound: Any) -> list[Any]:
        dbapi_conn = conn.dbapi_connection
        dialect.set_isolation_level(dbapi_conn, "AUTOCOMMIT")
        try:
            cursor = conn.cursor()
            try:
                cursor.execute(compiled.sql, bound)
                if compiled.processors is None:  # the column types' processors need the driver's type codes
                    compiled.processors = _processors(self.stmt, dialect, cursor.description)
                return list(cursor.fetchall())
            finally:
                cursor.close()
        finally:
            dialect.reset_isolation_level(dbapi_conn)


READ_POOL_NAME = "ballast-reads"
"""The read pool's connections' ``application_name`` (what ``pg_stat_activity`` shows for them)."""


class AsyncReadPool:
    """PostgreSQL connections for ``DriverRead.arows``: the API's hottest read on the event loop (psycopg's async
    API) instead of in a worker thread.

    Under load each worker-thread hop is a GIL hand-off between the event loop and a thread, and for
    ``GET /runs/{id}`` the hop cost more CPU than the read (~0.4 of ~1.3 ms per request in process). The
    connections are separate from the engine's pool, in autocommit, opened on demand, at most ``size`` of them;
    waiting for one is the back-pressure, and a wait past ``timeout`` (or a connect that fails) is a database
    error, the API's 503. As the engine's pool does, the most recently returned connection is handed out first, a
    connection idle longer than ``PING_IDLE_S`` is pinged before use and a dead one replaced, and one that breaks
    in use fails its request and is closed when it comes back. None of this exists for SQLite, whose driver
    blocks: there the read keeps its thread hop (``DriverRead.rows``).

    A plain stack rather than ``psycopg_pool``: its per-checkout machinery (a check callback, the return path
    through its worker tasks) cost ~0.07-0.2 ms of CPU per read, as much as a fifth of the whole request.
    """

    def __init__(self, engine: sa.Engine, size: int, timeout: float = 5.0) -> None:
        self.dialect = engine.dialect
        self.size = size
        self.timeout = timeout
        self._conninfo = engine.url.set(drivername="postgresql").render_as_string(hide_password=False)
        self._idle: list[tuple[psycopg.AsyncConnection[Any], float]] = []  # (connection, returned at), newest last
        self._slots: asyncio.Semaphore | None = None  # made on the event loop that uses the pool
        self._closed = False

    @classmethod
    def for_engine(cls, engine: sa.Engine, size: int) -> AsyncReadPool | None:
        """A pool for a PostgreSQL (psycopg) engine; None for any other."""
        if engine.dialect.name != "postgresql" or engine.dialect.driver != "psycopg":
            return None
        return cls(engine, size)

    async def close(self) -> None:
        """Close the idle connections; one in use is closed when it comes back."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn, _ in idle:
            await conn.close()

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """A connection for one read; one whose user raised (or was cancelled mid-query) is closed, not reused."""
        slots = self._slots
        if slots is None:
            slots = self._slots = asyncio.Semaphore(self.size)
        if slots.locked():  # wait_for costs a task: only when there is something to wait for
            try:
                await asyncio.wait_for(slots.acquire(), self.timeout)
            except TimeoutError:
                raise psycopg.OperationalError(f"no database connection free within {self.timeout:g} s") from None
        else:
            await slots.acquire()
        try:
            conn = await self._checkout()
            reusable = False
            try:
                yield conn
                reusable = not (self._closed or conn.broken or conn.closed)
            finally:
                if reusable:
                    self._idle.append((conn, time.monotonic()))
                else:
                    await conn.close()
        finally:
            slots.release()

    async def _checkout(self) -> psycopg.AsyncConnection[Any]:
        while self._idle:
            conn, returned = self._idle.pop()
            if time.monotonic() - returned <= PING_IDLE_S:
                return conn
            try:
                await conn.execute("")  # an empty query: a round trip that fails on a dead connection
                return conn
            except psycopg.Error:
                await conn.close()
        return await psycopg.AsyncConnection.connect(
            self._conninfo, autocommit=True, application_name=READ_POOL_NAME,
            connect_timeout=max(1, round(self.timeout)),
        )


@dataclass
class _Compiled:
    sql: str
    positions: tuple[str, ...] | None
    """Parameter names in order, for a positional paramstyle (SQLite's ``?``); None for named ones."""
    processors: tuple[Callable[[Any], Any] | None, ...] | None = None

    @classmethod
    def of(cls, stmt: sa.Select[Any], dialect: sa.Dialect) -> _Compiled:
        compiled = stmt.compile(dialect=dialect)
        return cls(str(compiled), tuple(compiled.positiontup or ()) if dialect.positional else None)

    def bind(self, params: Mapping[str, Any]) -> Any:
        if self.positions is None:
            return dict(params)
        return tuple(params[name] for name in self.positions)

    def process(self, raw: Sequence[Sequence[Any]]) -> list[tuple[Any, ...]]:
        """The driver's rows through the column types' result processors (set by the first execution)."""
        procs = self.processors
        assert procs is not None
        return [tuple(v if p is None or v is None else p(v) for p, v in zip(procs, row, strict=True)) for row in raw]


def _as_sqlalchemy_error(exc: Exception, compiled: _Compiled, bound: Any, dialect: sa.Dialect) -> sa.exc.StatementError:
    """The driver's error as SQLAlchemy's own execution raises it (a lost server is an OperationalError)."""
    return sa.exc.DBAPIError.instance(
        compiled.sql, bound, exc, dialect.loaded_dbapi.Error, connection_invalidated=True, dialect=dialect
    )


def _processors(
    stmt: sa.Select[Any], dialect: sa.Dialect, description: Sequence[Sequence[Any]]
) -> tuple[Callable[[Any], Any] | None, ...]:
    return tuple(
        c.type.dialect_impl(dialect).result_processor(dialect, d[1])
        for c, d in zip(stmt.selected_columns, description, strict=True)
    )
