"""`ballast serve` (API + scheduler in one process: one command to a working system) and `ballast scheduler`.

``serve`` migrates the database, refuses unsafe settings, and runs uvicorn with the scheduler attached to the
app's lifespan (a hook), so a SIGTERM or Ctrl-C stops the HTTP server and then the scheduler, in that order,
before the process exits 0. ``scheduler`` runs only the scheduler, for deployments with several API replicas
(``ballast serve --no-scheduler`` there).

Heavy imports (FastAPI app, Ray through the scheduler) happen inside the commands so that ``ballast --help``
and the client commands stay fast.
"""

from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from types import FrameType
from typing import TYPE_CHECKING, Annotated, Any

import typer

from api.cli.app import app, first_line
from api.cli.db_cmd import redacted_url
from orchestrator.settings import Settings, get_settings

if TYPE_CHECKING:
    from fastapi import FastAPI
    from sqlalchemy.orm import Session, sessionmaker

EXIT_REFUSED = 2


def _settings(host: str | None = None, port: int | None = None) -> Settings:
    """The environment's settings with the command-line overrides applied (and validated again)."""
    overrides: dict[str, Any] = {}
    if host is not None:
        overrides["bind_host"] = host
    if port is not None:
        overrides["bind_port"] = port
    return Settings(**overrides) if overrides else get_settings()


def _refuse(message: str) -> typer.Exit:
    typer.echo(f"ballast: refusing to start: {message}", err=True)
    return typer.Exit(EXIT_REFUSED)


def _prepare_database(settings: Settings, migrate: bool) -> sessionmaker[Session]:
    """Migrate (idempotent) and return a session factory; an unreachable database is a clear refusal."""
    import migrations
    from orchestrator.store.db import make_engine, make_session_factory

    if settings.database_url.startswith("sqlite"):
        settings.home.mkdir(parents=True, exist_ok=True)
    if migrate:
        try:
            migrations.upgrade(settings.database_url)
        except Exception as exc:  # OperationalError, a bad URL, a missing driver: the operator must fix it
            first = first_line(exc)
            raise _refuse(f"cannot migrate the database at {redacted_url(settings.database_url)}: {first}") from None
    return make_session_factory(make_engine(settings.database_url))


def stop_with_app(scheduler: Any) -> Callable[[FastAPI], Any]:
    """A lifespan hook that stops the (already started) scheduler when the app shuts down, after the server
    stopped taking requests. ``stop`` waits for the loop thread, so it runs off the event loop."""

    @asynccontextmanager
    async def hook(_app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await asyncio.to_thread(scheduler.stop)

    return hook


def _start_scheduler(scheduler: Any, ray: str) -> None:
    """``scheduler.start()`` (which connects to Ray) in a worker thread while this one waits.

    Waiting in the main thread keeps SIGINT/SIGTERM working while Ray starts (``ray.init`` can wait a long
    time for an unreachable address), and keeps Ray from replacing the process's SIGTERM handler (it installs
    one only when initialised from the main thread, and says so in a harmless warning).
    """
    errors: list[Exception] = []

    def target() -> None:
        try:
            scheduler.start()
        except Exception as exc:  # reported below as one line: a bad address or a broken Ray is operator input
            errors.append(exc)

    thread = threading.Thread(target=target, name="ballast-scheduler-start", daemon=True)
    thread.start()
    thread.join()
    if errors:
        raise _refuse(f"cannot start the scheduler on Ray ({ray}): {type(errors[0]).__name__}: "
                      f"{first_line(errors[0])}")


def _exit_cleanly(signum: int, _frame: FrameType | None) -> None:
    # uvicorn shuts down gracefully on SIGINT/SIGTERM, then re-raises the signal with the previous handler:
    # this one, so the process ends with status 0 after the lifespan (and the scheduler) stopped
    raise SystemExit(0)


@app.command("serve")
def serve(
    host: Annotated[
        str | None, typer.Option("--host", help="Bind address (default: BALLAST_BIND_HOST or 127.0.0.1).",
                                 show_default=False)
    ] = None,
    port: Annotated[
        int | None, typer.Option("--port", min=1, max=65535, help="Port (default: BALLAST_BIND_PORT or 8420).",
                                 show_default=False)
    ] = None,
    with_scheduler: Annotated[
        bool, typer.Option("--scheduler/--no-scheduler", help="Run the scheduler in this process.")
    ] = True,
    migrate: Annotated[bool, typer.Option("--migrate/--no-migrate", help="Apply database migrations first.")] = True,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn log level.")] = "info",
) -> None:
    """Run the API and the scheduler: local Ray and a SQLite file under BALLAST_HOME unless configured."""
    # from here on SIGINT/SIGTERM end the process cleanly (status 0), also while migrating or starting Ray;
    # uvicorn handles them itself while it serves, then re-raises them to these handlers
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _exit_cleanly)
    settings = _settings(host, port)
    try:
        settings.check_serving_safety()
    except ValueError as exc:
        raise _refuse(str(exc)) from None
    factory = _prepare_database(settings, migrate)

    import uvicorn

    from api.app import create_app

    ray = settings.ray_address or "local"
    sched: Any = None
    if with_scheduler:
        from orchestrator.scheduler import Scheduler

        sched = Scheduler(settings, factory)
    application = create_app(
        settings=settings, session_factory=factory, hooks=[stop_with_app(sched)] if sched is not None else []
    )
    config = uvicorn.Config(
        application, host=settings.bind_host, port=settings.bind_port, log_level=log_level, lifespan="on",
        timeout_graceful_shutdown=10,
    )
    try:
        if sched is not None:
            typer.echo(f"ballast: starting the scheduler (ray {ray}) ...", err=True)
            _start_scheduler(sched, ray)
        typer.echo(
            f"ballast: serving http://{settings.bind_host}:{settings.bind_port} "
            f"(database {redacted_url(settings.database_url)}, ray {ray if sched is not None else 'not used'}, "
            f"auth {settings.auth_mode.value})",
            err=True,
        )
        uvicorn.Server(config).run()
    finally:
        if sched is not None:
            sched.stop()  # already stopped with the app unless uvicorn never started; stopping twice is harmless


@app.command("scheduler")
def scheduler(
    migrate: Annotated[bool, typer.Option("--migrate/--no-migrate", help="Apply database migrations first.")] = True,
) -> None:
    """Run only the scheduler (claims queued runs, runs them on Ray); for deployments with several API replicas."""
    settings = get_settings()
    factory = _prepare_database(settings, migrate)
    from orchestrator.scheduler import Scheduler, stop_on_signals

    sched = Scheduler(settings, factory)
    ray = settings.ray_address or "local"
    typer.echo(f"ballast: starting the scheduler (database {redacted_url(settings.database_url)}, ray {ray}) ...",
               err=True)
    with stop_on_signals(sched.stop):
        sched.run_forever(on_running=lambda: typer.echo("ballast: scheduler running", err=True))
    typer.echo("ballast: scheduler stopped", err=True)

