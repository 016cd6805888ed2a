"""The scheduler's loop: ``Scheduler.tick()`` is one pass; ``start()``/``stop()`` run it in a background thread
(``ballast serve``), ``run_forever()`` in the foreground (``ballast scheduler``, ``python -m
orchestrator.scheduler``). Each tick renews the leases of the runs it drives, services their worker groups,
adopts orphaned runs now and then, claims queued runs while there is room, and keeps the configured standby worker
groups started (``orchestrator.scheduler.launcher``)."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from sqlalchemy.orm import Session, sessionmaker

from orchestrator.scheduler.adoption import reconcile
from orchestrator.scheduler.claims import claim, default_scheduler_id, free_cpus, release_leases, renew_leases
from orchestrator.scheduler.context import Context
from orchestrator.scheduler.launcher import Launcher, RayLauncher
from orchestrator.scheduler.launching import standby_template
from orchestrator.scheduler.outage import OutageLog, is_outage
from orchestrator.scheduler.service import service_all
from orchestrator.scheduler.signals import reclaim_signals, stop_on_signals
from orchestrator.settings import Settings

log = logging.getLogger("ballast.scheduler")


class Scheduler:
    """See the package docstring. ``tick()`` is one pass; ``start()``/``stop()`` run it in a thread."""

    def __init__(
        self,
        settings: Settings,
        session_factory: sessionmaker[Session],
        scheduler_id: str | None = None,
        *,
        launcher: Launcher | None = None,
        lease_seconds: float | None = None,
        train_fn: str | None = None,
    ) -> None:
        scheduler_id = scheduler_id or default_scheduler_id()
        self.ctx = Context(
            settings=settings,
            sf=session_factory,
            id=scheduler_id,
            launcher=launcher if launcher is not None else RayLauncher(settings, scheduler_id),
            lease_seconds=lease_seconds or max(30.0, 20 * settings.scheduler_poll_seconds),
            train_fn=train_fn,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._connected = False
        self._next_reconcile = 0.0
        self._outage = OutageLog(log)

    @property
    def id(self) -> str:
        return self.ctx.id

    @property
    def settings(self) -> Settings:
        return self.ctx.settings

    @property
    def launcher(self) -> Launcher:
        return self.ctx.launcher

    @property
    def active_runs(self) -> list[int]:
        return sorted(self.ctx.executions)

    # ------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Run the loop in a background thread (``ballast serve``); returns once Ray is connected.

        The loop thread itself connects: a local Ray's processes (GCS, raylet) are started with a parent-death
        signal bound to the *thread* that forks them, so connecting from a short-lived thread would kill the
        local cluster as soon as that thread ends.
        """
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        connected = threading.Event()
        errors: list[BaseException] = []

        def main() -> None:
            try:
                self._ensure_connected()
            except BaseException as exc:  # handed to start()'s caller below
                errors.append(exc)
                return
            finally:
                connected.set()
            self._loop()

        self._thread = threading.Thread(target=main, name="ballast-scheduler", daemon=True)
        self._thread.start()
        connected.wait()
        if errors:
            self._thread = None
            raise errors[0]

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop (from any thread); runs keep going on a Ray cluster and are adopted on restart."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
            self._thread = None

    def run_forever(self, on_running: Callable[[], None] | None = None) -> None:
        """Run the loop until ``stop()`` (``ballast scheduler``), this thread waiting for it.

        The loop runs in its own thread (``start``), which connects to Ray: a Ray initialised from the main thread
        installs its own SIGTERM handler (``sys.exit(15)``), and its core worker a C++ one that prints a stack
        dump, which ``reclaim_signals`` replaces again: the caller's handlers (``stop_on_signals``) stay in charge,
        and a SIGTERM stops the loop, which releases its leases and shuts a local Ray down before this returns.
        ``on_running`` is called once that holds (Ray connected, the handlers reclaimed); a signal that arrives
        while Ray is still starting meets Ray's handler.
        """
        self.start()
        reclaim_signals()  # Ray's C++ SIGTERM handler (a stack dump) out, the caller's back
        if on_running is not None:
            on_running()
        thread = self._thread
        while thread is not None and thread.is_alive():
            thread.join(0.5)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    self.tick()
                except Exception as exc:  # noqa: BLE001 - the loop must outlive a bad tick (DB outage, Ray timeout)
                    if is_outage(exc):
                        self._outage.failed(exc)  # one line per tick, never a traceback
                    else:
                        log.exception("scheduler tick failed")
                else:
                    self._outage.succeeded()
                elapsed = time.monotonic() - started
                self._stop.wait(max(0.0, self.ctx.settings.scheduler_poll_seconds - elapsed))
        finally:
            release_leases(self.ctx)
            self.ctx.launcher.shutdown()
            self._connected = False

    def _ensure_connected(self) -> None:
        if not self._connected:
            self.ctx.launcher.connect()
            self._connected = True

    # ------------------------------------------------------------------------------------------- tick
    def tick(self) -> None:
        """One pass: renew leases, service active runs, adopt orphaned ones, claim queued ones."""
        self._ensure_connected()
        renew_leases(self.ctx)
        service_all(self.ctx, list(self.ctx.executions.values()))  # an outage fails the tick: logged by the loop
        now = time.monotonic()
        if now >= self._next_reconcile:
            reconcile(self.ctx)
            self._next_reconcile = now + max(1.0, self.ctx.lease_seconds / 3)
        claim(self.ctx)
        if self.ctx.settings.standby_worker_groups:
            self.ctx.launcher.keep_standby(standby_template(self.ctx), free_cpus(self.ctx))


def main(settings: Settings | None = None) -> None:
    """Run the scheduler alone in the foreground until SIGINT/SIGTERM (``ballast scheduler`` uses the class
    directly; this is for ``python -m orchestrator.scheduler``)."""
    from orchestrator.settings import get_settings
    from orchestrator.store.db import make_engine, make_session_factory

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = settings or get_settings()
    factory = make_session_factory(make_engine(settings.database_url))
    scheduler = Scheduler(settings, factory, os.environ.get("BALLAST_SCHEDULER_ID") or None)
    with stop_on_signals(scheduler.stop):
        scheduler.run_forever()
