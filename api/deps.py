"""Request dependencies as types (``SessionDep``, ``SettingsDep``): routes take these, nothing global.

Authentication and the tenancy-checked run lookups (``ReadableRun``, ``WritableRun``) are in ``api.auth``.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar, TypeVarTuple

import anyio
from fastapi import Depends, Path, Request
from pydantic_core import PydanticSerializationError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.errors import ApiError
from contracts.recipe import (
    FieldError,
    Recipe,
    RecipeError,
    load_recipe,
    recipe_to_dict,
    validate_recipe_data,
)
from orchestrator.settings import Settings
from orchestrator.store.repo import content_hash

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

MAX_ID = 2**31 - 1  # ids are INTEGER on PostgreSQL: a larger one is simply not there, not a database error


async def get_app_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


SettingsDep = Annotated[Settings, Depends(get_app_settings)]


async def get_session(request: Request) -> AsyncIterator[Session]:
    """One session per request; routes that write call ``session.commit()`` (the caller owns the transaction).

    Async so that FastAPI does not spend a worker-thread hop on it: creating a session does no I/O (it connects
    on first use, in the route's thread); closing it returns the connection (a rollback), so that runs in one.
    """
    factory: sessionmaker[Session] | None = request.app.state.session_factory
    if factory is None:
        raise ApiError(503, "the database is not set up yet", slug="database-unavailable")
    async with _db_slots(request.app.state, factory):
        session = factory()
        try:
            yield session
        finally:
            if session.in_transaction():
                await run_in_threadpool(session.close)  # returns a connection: a rollback, which is I/O
            else:
                session.close()  # nothing checked out (unused, committed, or closed by in_db_thread): no I/O


def without_transaction(session: Session) -> None:
    """Run the session's statements without a transaction: for a read that is a single statement (which sees one
    snapshot by itself), BEGIN and the ROLLBACK that returns the connection are two round trips for nothing.
    The connection's isolation level is restored when it goes back to the pool. A session already in a
    transaction (the token check queried on a cache miss) keeps it."""
    if not session.in_transaction():
        session.connection(execution_options={"isolation_level": "AUTOCOMMIT"})


async def in_db_thread(session: Session, work: Callable[[*Ts], T], *args: *Ts) -> T:
    """``work(*args)`` (blocking database work on ``session``) in one worker-thread hop, then the session closed
    in the same hop; for ``async`` routes.

    A sync route costs a hop per sync dependency, one for the route, one more for FastAPI to validate its return
    value and one for closing the session: under load each hop is a GIL hand-off between the event loop and a
    worker, which costs more CPU than the queries. Build the response in ``work`` (the session's objects are
    detached afterwards) and return it; FastAPI then validates it on the loop, where a model instance costs an
    ``isinstance`` check.
    """

    def run() -> T:
        try:
            return work(*args)
        finally:
            session.close()

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


# ---------------------------------------------------------------------------------------------- recipe bodies
RECIPE_MEDIA_TYPES = {
    "application/json": "json",
    "application/yaml": "yaml",
    "application/x-yaml": "yaml",
    "text/yaml": "yaml",
}


@dataclass(frozen=True)
class SubmittedRecipe:
    """A recipe body that parsed and validated: the model, its normalised dict and hash, and the text as sent."""

    recipe: Recipe
    normalised: dict[str, Any]
    content_hash: str
    text: str


def _reject_unstorable(value: Any, path: str, out: list[FieldError]) -> None:
    """Values a JSON column cannot hold faithfully on every backend: non-finite floats, NUL, lone surrogates."""
    if isinstance(value, float) and not math.isfinite(value):
        out.append(FieldError(path or "<recipe>", "must be a finite number"))
    elif isinstance(value, str):
        if "\x00" in value:
            out.append(FieldError(path or "<recipe>", "must not contain NUL characters"))
        else:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                out.append(FieldError(path or "<recipe>", "is not valid Unicode (lone surrogate)"))
    elif isinstance(value, dict):
        for k, v in value.items():
            key = str(k)
            _reject_unstorable(key, f"{path}.{key}" if path else key, out)
            _reject_unstorable(v, f"{path}.{key}" if path else key, out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _reject_unstorable(v, f"{path}.{i}" if path else str(i), out)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise RecipeError([FieldError("<document>", f"duplicate key {k!r}")])
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise RecipeError([FieldError("<document>", f"invalid JSON: {name} is not a number")])


def parse_recipe_body(body: bytes, fmt: str, settings: Settings) -> SubmittedRecipe:
    """Bytes of a YAML or JSON recipe → SubmittedRecipe, or RecipeError naming each field (and YAML line)."""
    allowed = list(settings.allowed_import_modules)
    try:
        if fmt == "yaml":
            recipe = load_recipe(body, max_bytes=settings.max_recipe_bytes, allowed_import_modules=allowed)
            text = body.decode("utf-8")
        else:
            try:
                text = body.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RecipeError([FieldError("<document>", f"not UTF-8 text ({exc.reason})")]) from None
            try:
                data = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants)
            except json.JSONDecodeError as exc:
                raise RecipeError([FieldError("<document>", f"invalid JSON: {exc.msg}", exc.lineno)]) from None
            recipe = validate_recipe_data(data, allowed_import_modules=allowed)
        normalised = recipe_to_dict(recipe)
    except RecursionError:
        raise RecipeError([FieldError("<document>", "the document is nested too deeply")]) from None
    except PydanticSerializationError as exc:
        raise RecipeError([FieldError("<recipe>", f"a value cannot be represented as JSON ({exc})")]) from None
    problems: list[FieldError] = []
    _reject_unstorable(normalised, "", problems)
    if problems:
        raise RecipeError(problems)
    return SubmittedRecipe(recipe, normalised, content_hash(normalised), text)


INLINE_PARSE_BYTES = 8 * 1024
"""JSON recipes up to this size are parsed on the event loop: a typical one (~1 KiB) takes ~0.15 ms, less CPU than
the worker-thread hop would, and this size bounds the worst case to a few ms. YAML (a much slower parser, and the
one a "bomb" targets) and larger bodies are parsed in a worker thread."""


async def read_recipe_body(request: Request, settings: SettingsDep) -> SubmittedRecipe:
    """Check the content type (415) and size (413, before any parsing), then parse (off the event loop unless it
    is a small JSON body)."""
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    fmt = RECIPE_MEDIA_TYPES.get(media)
    if fmt is None:
        raise ApiError(
            415,
            f"send the recipe as one of {sorted(RECIPE_MEDIA_TYPES)}, not {media or 'no content type'!r}",
            slug="unsupported-media-type",
        )
    limit = settings.max_recipe_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the recipe is {declared} bytes, over the limit of {limit}", slug="too-large")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise ApiError(413, f"the recipe is over the limit of {limit} bytes", slug="too-large")
    if fmt == "json" and len(buf) <= INLINE_PARSE_BYTES:
        return parse_recipe_body(bytes(buf), fmt, settings)
    return await run_in_threadpool(parse_recipe_body, bytes(buf), fmt, settings)


RecipeBody = Annotated[SubmittedRecipe, Depends(read_recipe_body)]

_RECIPE_EXAMPLE_YAML = """\
apiVersion: ballast/v1
kind: StabilityRecipe
name: tiny-gpt-demo
model: {name: tiny_gpt, n_layers: 2, d_model: 64}
data: {name: markov, vocab_size: 64}
training: {max_steps: 200, batch_size: 16}
optimizer: {name: adamw, lr: 0.003}
clipping: {method: global_norm, max_norm: 1.0}
"""
_RECIPE_EXAMPLE_JSON: dict[str, Any] = {
    "apiVersion": "ballast/v1",
    "kind": "StabilityRecipe",
    "name": "tiny-gpt-demo",
    "model": {"name": "tiny_gpt", "n_layers": 2, "d_model": 64},
    "data": {"name": "markov", "vocab_size": 64},
    "training": {"max_steps": 200, "batch_size": 16},
    "optimizer": {"name": "adamw", "lr": 0.003},
    "clipping": {"method": "global_norm", "max_norm": 1.0},
}


def recipe_request_body(description: str) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of an endpoint that takes a recipe (read by ``read_recipe_body``)."""
    ref = {"$ref": "#/components/schemas/Recipe"}
    content: dict[str, Any] = {}
    for media, fmt in RECIPE_MEDIA_TYPES.items():
        example = _RECIPE_EXAMPLE_JSON if fmt == "json" else _RECIPE_EXAMPLE_YAML
        content[media] = {"schema": ref, "example": example}
    return {"requestBody": {"required": True, "description": description, "content": content}}


async def require_json(request: Request) -> None:
    """415 for a non-empty body that is not JSON (instead of a confusing 422 about the body's type)."""
    declared = request.headers.get("content-length")
    has_body = (declared is not None and declared != "0") or "transfer-encoding" in request.headers
    if not has_body:
        return
    media = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"send JSON (application/json), not {media or 'no content type'!r}",
                       slug="unsupported-media-type")
