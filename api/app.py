"""The FastAPI application: ``create_app(settings, session_factory)``.

``app.state`` holds what routes and hooks need: ``settings``, ``session_factory`` (built from
``settings.database_url`` in the lifespan unless one is passed in), ``engine`` (when the lifespan built it),
``read_pool`` (PostgreSQL connections for reads on the event loop, while the lifespan runs; None otherwise),
``metrics`` (the app's Prometheus registry), ``event_poll_seconds`` (SSE poll period) and
``lifespan_hooks``: async context-manager factories ``hook(app)`` entered after the database is set up and
exited at shutdown, in reverse order. ``ballast serve`` uses a hook to run the scheduler in the same process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import AbstractAsyncContextManager, AsyncExitStack, asynccontextmanager
from typing import Any

import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from sqlalchemy.orm import Session, sessionmaker

import api
from api.auth import TokenCache
from api.bodies import BodyLimitMiddleware
from api.deps import DB_CONCURRENCY
from api.errors import install_error_handlers
from api.metrics import AppMetrics, LatencyMiddleware
from api.routes import API_PREFIX, api_routers, health_router
from api.routes.dashboard import install_dashboard
from api.schemas import Problem
from contracts.recipe import Recipe
from orchestrator.settings import Settings, get_settings
from orchestrator.store.db import AsyncReadPool, make_engine, make_session_factory

LifespanHook = Callable[[FastAPI], AbstractAsyncContextManager[Any]]

DESCRIPTION = """\
Ballast keeps training runs from blowing up: submit a **stability recipe** (YAML or JSON), and the orchestrator
runs it on Ray Train, detects divergence, rolls back to a healthy checkpoint and retries with tightened
settings.

* Authentication: `Authorization: Bearer <token>` (tokens from `ballast token create`), unless the server runs
  with auth off on a loopback address. Scopes: `read`, `submit`, `admin`. A principal sees only its own runs.
* Errors are [RFC 9457](https://www.rfc-editor.org/rfc/rfc9457) problem documents
  (`application/problem+json`); invalid input lists each field in `errors` with its path (and YAML line).
* Lists return `{"data": [...], "count": n, "next": cursor}`; pass `next` back as `cursor`.
"""


@asynccontextmanager
async def _lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = None
    if app.state.session_factory is None:
        engine = make_engine(app.state.settings.database_url)
        app.state.engine = engine
        app.state.session_factory = make_session_factory(engine)
    bind = app.state.session_factory.kw.get("bind")
    read_pool = AsyncReadPool.for_engine(bind, DB_CONCURRENCY) if isinstance(bind, sa.Engine) else None
    app.state.read_pool = read_pool
    try:
        async with AsyncExitStack() as stack:
            for hook in list(app.state.lifespan_hooks):
                await stack.enter_async_context(hook(app))
            yield
    finally:
        if read_pool is not None:
            app.state.read_pool = None
            await read_pool.close()
        if engine is not None:
            app.state.session_factory = None
            app.state.engine = None
            engine.dispose()


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    """The generated schema plus the recipe schema (request bodies are read by hand, so FastAPI cannot see it)
    and the problem document, both referenced from ``#/components/schemas``."""

    def build() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(
            title=app.title, version=app.version, description=app.description, routes=app.routes,
            tags=app.openapi_tags,
        )
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model, name in ((Recipe, "Recipe"), (Problem, "Problem")):
            doc = model.model_json_schema(by_alias=True, ref_template="#/components/schemas/{model}")
            for def_name, def_schema in doc.pop("$defs", {}).items():
                if components.setdefault(def_name, def_schema) != def_schema:
                    raise RuntimeError(f"OpenAPI schema name clash: {def_name}")
            components[name] = doc
        app.openapi_schema = schema
        return schema

    return build


def create_app(
    settings: Settings | None = None,
    session_factory: sessionmaker[Session] | None = None,
    *,
    hooks: Sequence[LifespanHook] = (),
) -> FastAPI:
    """Build the API. Refuses (ValueError) settings that are unsafe to serve, e.g. auth off on a public bind."""
    settings = settings or get_settings()
    settings.check_serving_safety()
    app = FastAPI(
        title="Ballast",
        version=getattr(api, "__version__", "0.1.0"),
        description=DESCRIPTION,
        lifespan=_lifespan,
        docs_url=None,  # /docs and /redoc come from install_dashboard, on vendored assets
        redoc_url=None,
        openapi_tags=[
            {"name": "runs", "description": "Submit, list, inspect, cancel and retry runs."},
            {"name": "recipes", "description": "Validate recipes; the recipe schema."},
            {"name": "attempts", "description": "Each try at a run."},
            {"name": "anomalies", "description": "What the detectors found."},
            {"name": "checkpoints", "description": "Saved checkpoints and their health."},
            {"name": "metrics", "description": "Per-step metric series."},
            {"name": "events", "description": "Live event stream (SSE)."},
            {"name": "tokens", "description": "API tokens (admin)."},
            {"name": "health", "description": "Probes and Prometheus metrics."},
        ],
    )
    app.state.settings = settings
    app.state.session_factory = session_factory
    app.state.engine = None
    app.state.read_pool = None  # set by the lifespan for PostgreSQL (``AsyncReadPool``)
    app.state.event_poll_seconds = 0.5
    app.state.lifespan_hooks = list(hooks)
    app.state.metrics = AppMetrics(lambda: app.state.session_factory)
    app.state.token_cache = TokenCache()
    install_error_handlers(app)
    for router in api_routers:
        app.include_router(router, prefix=API_PREFIX)
    app.include_router(health_router)
    install_dashboard(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_recipe_bytes)
    app.add_middleware(LatencyMiddleware, metrics=app.state.metrics, prefix=API_PREFIX)
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    return app
