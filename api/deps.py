"""Dependency injection only: request dependencies as types (``SettingsDep``, ``SessionDep``, ``RunId``), and how
a route does its database work in one worker-thread hop. Routes take these, nothing global.

The principal and the tenancy-checked run lookups (``ReadPrincipal``, ``ReadableRun``, ...) are in ``api.auth``;
request bodies (size limit, content types, recipes) in ``api.bodies``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any, TypeVar, TypeVarTuple

import anyio
from fastapi import Depends, Path, Request
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError
from orchestrator.settings import Settings

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

MAX_ID = 2**31 - 1  # ids are INTEGER on PostgreSQL: a larger one is simply not there, not a database error


async def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


def session_factory(request: Request) -> sessionmaker[Session]:
    """The app's session factory; 503 until the lifespan has set up the database."""
    factory: sessionmaker[Session] | None = request.app.state.session_factory
    if factory is None:
        raise ApiError(503, "the database is not set up yet", slug="database-unavailable")
    return factory


async def get_session(request: Request) -> AsyncIterator[Session]:
    """One session per request, for sync routes; routes that write call ``session.commit()`` (the caller owns the
    transaction). ``async`` routes use ``in_db_thread`` instead.

    Async so that FastAPI does not spend a worker-thread hop on it: creating a session does no I/O (it connects
    on first use, in the route's thread); closing it returns the connection (a rollback), so that runs in one.
    """
    factory = session_factory(request)
    async with _db_slots(request.app.state, factory):
        session = factory()
        try:
            yield session
        finally:
            if session.in_transaction():
                await run_in_threadpool(session.close)  # returns a connection: a rollback, which is I/O
            else:
                session.close()  # nothing checked out (unused or committed): no I/O


async def in_db_thread(request: Request, work: Callable[[Session, *Ts], T], *args: *Ts) -> T:
    """``work(session, *args)`` (blocking database work on a session of its own) in one worker-thread hop, the
    session closed in the same hop; for ``async`` routes.

    A sync route costs a hop per sync dependency, one for the route, one more for FastAPI to validate its return
    value and one for closing the session, and a generator dependency (``SessionDep``) costs FastAPI an exit
    stack: under load each hop is a GIL hand-off between the event loop and a worker, which costs more CPU than
    the queries. Build the response in ``work`` (the session's objects are detached afterwards) and return it;
    FastAPI then validates it on the loop, where a model instance costs an ``isinstance`` check.
    """
    factory = session_factory(request)

    def run() -> T:
        with factory() as session:
            return work(session, *args)

    async with _db_slots(request.app.state, factory):
        return await run_in_threadpool(run)


DB_CONCURRENCY = 8
"""Requests of one process that hold a database session at once, at most (fewer if the pool is smaller).

The routes' database work is mostly Python (building statements, reading rows, validating responses) under one
GIL, so concurrency beyond what hides the round trips buys no throughput: each extra thread in flight only adds
GIL hand-offs. Measured on GET /runs/{id} with 64 clients: 20 in flight cost ~20 % more CPU per request than 4;
8 keeps most of that gain while a few slow queries still leave room for the rest."""


def _db_slots(state: Any, factory: sessionmaker[Session]) -> anyio.CapacityLimiter:
    """At most ``DB_CONCURRENCY`` requests with a session, and never more than the pool keeps open.

    A request checks a connection out in one worker thread and may use it again in the next; were more requests
    in flight than connections, the holders could wait for threads that are all blocked waiting for a connection
    (QueuePool timeouts under load). Waiting here, before any connection is taken, is plain back-pressure. The
    bound is at most the pool's size, not size + overflow: an overflow connection is closed as soon as it is
    returned, so admitting requests into the overflow under steady load opens (and PostgreSQL forks) a new
    connection every few requests, which costs more than the queries. The overflow is left to the other users
    of the engine (the scheduler, in ``ballast serve``).
    """
    key = (id(factory), id(asyncio.get_running_loop()))  # a test client may run each request in a new loop
    slots: tuple[tuple[int, int], anyio.CapacityLimiter] | None = getattr(state, "db_slots", None)
    if slots is None or slots[0] != key:
        slots = (key, anyio.CapacityLimiter(_pool_capacity(factory)))
        state.db_slots = slots
    return slots[1]


def _pool_capacity(factory: sessionmaker[Session]) -> int:
    bind = factory.kw.get("bind")
    pool = getattr(bind, "pool", None)
    size = getattr(pool, "size", None)
    if pool is None or not callable(size):
        return DB_CONCURRENCY  # no bounded pool (e.g. NullPool)
    return max(1, min(DB_CONCURRENCY, int(size())))


SessionDep = Annotated[Session, Depends(get_session, scope="function")]
"""Closed when the route function returns, before the response is sent: a long event stream holds no connection,
and routes return response models built while the session is open."""

RunId = Annotated[int, Path(ge=1, le=MAX_ID, description="Run id.", examples=[1])]
