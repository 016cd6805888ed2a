"""The scheduler: claims queued runs, runs their attempts on Ray, streams their events into the store, and
closes the recovery loop (divergence or crash → ``orchestrator.policy.recovery.decide`` → the next attempt).

One loop (``tick``), run in a background thread by ``ballast serve`` (``start``/``stop``) or in the foreground
by ``ballast scheduler`` (``run_forever``). Each tick:

1. renews the lease of every run this scheduler drives (``runs.claimed_by`` / ``lease_expires_at``);
2. polls each run's channel actor (``orchestrator.channel.RunChannel``): ingests its events
   (``orchestrator.store.ingest``), answers in-place recovery requests, passes on cancellation, and when the
   worker group has ended maps its outcome onto the attempt and asks the policy what comes next;
3. adopts active runs whose lease expired (their scheduler died): reattaches to their channel actor if their
   Ray work still runs, else records the attempt as crashed and resumes per policy;
4. claims queued runs while it has room (``max_concurrent_runs``, the cluster's free CPUs). On PostgreSQL the
   claim is ``SELECT ... FOR UPDATE SKIP LOCKED``, so several schedulers never claim the same run; on SQLite
   (one machine) a conditional ``UPDATE ... WHERE state = 'queued'`` does the same under SQLite's write lock.

Every state change goes through ``set_run_state`` / ``set_attempt_state``. The database is committed before
anything is told to the workers (a plan answer, a launch), so a scheduler that dies in between leaves a state
the next one can finish from.

Each worker group runs as a Ray Train ``TorchTrainer`` inside its channel actor, a detached, named actor: the
Ray work does not belong to this process, so a restarted scheduler (with a Ray cluster that outlived it) finds
it again. A local Ray started by this process dies with it; its runs are then resumed from their checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import shutil
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import FrameType
from typing import Any, Protocol

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from contracts import checkpoint as contracts_checkpoint
from contracts.checkpoint import CorruptCheckpoint, checkpoints_to_delete, local_dir
from contracts.recipe import CustomData, CustomModel, Recipe, RecipeError, validate_recipe_data
from contracts.wire import AttemptSpec
from orchestrator.channel import NAMESPACE, channel_actor_class
from orchestrator.policy.recovery import (
    ATTEMPT_KINDS,
    AttemptRecord,
    CheckpointRecord,
    GiveUp,
    RecoveryPlan,
    decide,
    effective_recipe,
)
from orchestrator.policy.states import (
    ACTIVE_RUN_STATES,
    TERMINAL_ATTEMPT_STATES,
    TERMINAL_RUN_STATES,
    AttemptState,
    RunState,
)
from orchestrator.settings import Settings
from orchestrator.store.db import transaction
from orchestrator.store.ingest import ingest_events, jsonable
from orchestrator.store.ingest import number_or_none as finite_or_none
from orchestrator.store.models import Attempt, CheckpointRow, Run, utcnow
from orchestrator.store.repo import set_attempt_state, set_run_state

log = logging.getLogger("ballast.scheduler")

CANCEL_GRACE_S = 7.0
"""After asking a worker group to stop, wait this long before killing it (the API promises 10 s)."""
MAX_POLICY_ROUNDS = 8
"""Times the policy is asked again after its chosen checkpoint turned out corrupt."""
OUTCOME_STATE = {
    "succeeded": AttemptState.succeeded,
    "diverged": AttemptState.diverged,
    "crashed": AttemptState.crashed,
    "cancelled": AttemptState.cancelled,
}


class ChannelLost(Exception):
    """The run's channel actor (and with it the worker group) is gone."""


class _NoRoom(Exception):
    """The cluster lacks the CPUs for this run now (aborts the claim's transaction)."""


# ---------------------------------------------------------------------------------------------- launcher
class Launcher(Protocol):
    """How the scheduler reaches the compute: Ray in production; a fake in the fast scheduler tests."""

    def connect(self) -> None: ...

    def shutdown(self) -> None: ...

    def free_cpus(self) -> float | None: ...

    def launch(self, *, name: str, run_id: int, attempt: int, launch: dict[str, Any]) -> Any: ...

    def attach(self, name: str) -> Any | None: ...

    def poll(self, handle: Any, acked: Mapping[int, int]) -> dict[str, Any] | None: ...

    def request_stop(self, handle: Any) -> None: ...

    def answer_plan(self, handle: Any, attempt: int, plan: dict[str, Any] | None) -> None: ...

    def kill(self, handle: Any) -> None: ...


class RayLauncher:
    """Worker groups as ``RunChannel`` actors (detached, named in the ``ballast`` namespace) on Ray."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._owns_ray = False

    def connect(self) -> None:
        """``settings.ray_address`` if set, else a local Ray; an already initialised Ray is used as it is."""
        import ray

        if ray.is_initialized():
            return
        os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
        if self.settings.ray_address:
            ray.init(address=self.settings.ray_address, namespace=NAMESPACE, log_to_driver=False)
        else:
            ray.init(num_cpus=self.settings.ray_num_cpus, namespace=NAMESPACE, include_dashboard=False,
                     log_to_driver=False)
            self._owns_ray = True

    def shutdown(self) -> None:
        import ray

        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def free_cpus(self) -> float | None:
        import ray

        resources: dict[str, float] = ray.available_resources()  # type: ignore[no-untyped-call]
        return float(resources.get("CPU", 0.0))

    def launch(self, *, name: str, run_id: int, attempt: int, launch: dict[str, Any]) -> Any:
        import ray

        cls = channel_actor_class()
        handle = cls.options(name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True).remote(
            run_id, attempt
        )
        status = ray.get(handle.fit_status.remote(), timeout=60)
        if status.get("state") == "idle":  # get_if_exists found nothing running: this call starts it
            ray.get(handle.start.remote(launch), timeout=60)
        return handle

    def attach(self, name: str) -> Any | None:
        import ray

        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            ray.get(handle.ping.remote(), timeout=15)
        except (ValueError, ray.exceptions.RayError):
            return None
        return handle

    def poll(self, handle: Any, acked: Mapping[int, int]) -> dict[str, Any] | None:
        import ray

        try:
            result: dict[str, Any] = ray.get(handle.poll.remote(dict(acked)), timeout=30)
        except ray.exceptions.GetTimeoutError:
            return None  # busy or slow: try again next tick
        except ray.exceptions.RayError as exc:
            raise ChannelLost(f"{type(exc).__name__}: {_one_line(exc)}") from None
        return result

    def request_stop(self, handle: Any) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(handle.request_stop.remote(), timeout=15)

    def answer_plan(self, handle: Any, attempt: int, plan: dict[str, Any] | None) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(handle.answer_plan.remote(attempt, plan), timeout=15)

    def kill(self, handle: Any) -> None:
        """End the worker group now: the actor, its Train controller and workers, and their placement group."""
        import ray
        from ray.util import remove_placement_group

        groups: list[Any] = []
        with contextlib.suppress(ray.exceptions.RayError):
            groups = ray.get(handle.placement_groups.remote(), timeout=10)
        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            ray.kill(handle, no_restart=True)
        for pg in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)


# ------------------------------------------------------------------------------------------- scheduler
@dataclass
class _Execution:
    """A worker group this scheduler drives."""

    run_id: int
    name: str
    handle: Any
    attempt: int
    """The attempt the worker group runs now (it moves on with in-place recoveries)."""
    demand_cpus: float
    started: bool = False
    stop_sent_at: float | None = None


def default_scheduler_id() -> str:
    """``host:pid:nonce``: lets a restarted scheduler on the same host see that the old owner is dead."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _owner_is_dead_here(claimed_by: str | None) -> bool:
    """True when the claim belongs to a scheduler process on this host that no longer exists."""
    if not claimed_by:
        return True
    parts = claimed_by.split(":")
    if len(parts) != 3 or parts[0] != socket.gethostname() or not parts[1].isdigit():
        return False
    pid = int(parts[1])
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class Scheduler:
    """See the module docstring. ``tick()`` is one pass; ``start()``/``stop()`` run it in a thread."""

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
        self.settings = settings
        self.sf = session_factory
        self.id = scheduler_id or default_scheduler_id()
        self.launcher: Launcher = launcher if launcher is not None else RayLauncher(settings)
        self.lease_seconds = lease_seconds or max(30.0, 20 * settings.scheduler_poll_seconds)
        self.train_fn = train_fn
        self._executions: dict[int, _Execution] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._connected = False
        self._reconciled_once = False
        self._next_reconcile = 0.0

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

    def run_forever(self) -> None:
        """The loop in this thread, until ``stop()`` (``ballast scheduler``)."""
        self._stop.clear()
        self._ensure_connected()
        self._loop()

    @property
    def active_runs(self) -> list[int]:
        return sorted(self._executions)

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    self.tick()
                except Exception:  # noqa: BLE001 - the loop must outlive a bad tick (DB hiccup, Ray timeout)
                    log.exception("scheduler tick failed")
                elapsed = time.monotonic() - started
                self._stop.wait(max(0.0, self.settings.scheduler_poll_seconds - elapsed))
        finally:
            self._release_leases()
            self.launcher.shutdown()
            self._connected = False

    def _ensure_connected(self) -> None:
        if not self._connected:
            self.launcher.connect()
            self._connected = True

    # ------------------------------------------------------------------------------------------- tick
    def tick(self) -> None:
        """One pass: renew leases, service active runs, adopt orphaned ones, claim queued ones."""
        self._ensure_connected()
        self._renew_leases()
        for ex in list(self._executions.values()):
            try:
                self._service(ex)
            except Exception:  # noqa: BLE001 - one run's failure must not stall the others
                log.exception("servicing run %s failed", ex.run_id)
        now = time.monotonic()
        if now >= self._next_reconcile:
            self._reconcile()
            self._next_reconcile = now + max(1.0, self.lease_seconds / 3)
        self._claim()

    # ----------------------------------------------------------------------------------------- leases
    def _lease_until(self) -> Any:
        return utcnow() + timedelta(seconds=self.lease_seconds)

    def _renew_leases(self) -> None:
        if not self._executions:
            return
        with transaction(self.sf) as s:
            s.execute(
                sa.update(Run)
                .where(Run.id.in_(list(self._executions)), Run.claimed_by == self.id)
                .values(lease_expires_at=self._lease_until())
            )

    def _release_leases(self) -> None:
        """On a clean stop: let another scheduler adopt our runs at once instead of after the lease."""
        if not self._executions:
            return
        with contextlib.suppress(Exception), transaction(self.sf) as s:
            s.execute(
                sa.update(Run)
                .where(Run.id.in_(list(self._executions)), Run.claimed_by == self.id)
                .values(lease_expires_at=utcnow())
            )
        self._executions.clear()

    def _lock_run(self, s: Session, run_id: int, *conditions: Any) -> bool:
        """Take ``run_id`` for this scheduler if ``conditions`` hold, never racing another scheduler.

        PostgreSQL: row lock with SKIP LOCKED (a run another scheduler is claiming is simply skipped).
        SQLite: a conditional UPDATE as the transaction's first statement, so it runs under the write lock
        against the newest data.
        """
        if s.get_bind().dialect.name == "postgresql":
            got = s.execute(
                sa.select(Run.id).where(Run.id == run_id, *conditions).with_for_update(skip_locked=True)
            ).first()
            if got is None:
                return False
            s.execute(
                sa.update(Run).where(Run.id == run_id).values(claimed_by=self.id, lease_expires_at=self._lease_until())
            )
            return True
        result = s.execute(
            sa.update(Run)
            .where(Run.id == run_id, *conditions)
            .values(claimed_by=self.id, lease_expires_at=self._lease_until())
        )
        return bool(getattr(result, "rowcount", 0))

    # ------------------------------------------------------------------------------------------ claim
    def _claim(self) -> None:
        slots = self.settings.max_concurrent_runs - len(self._executions)
        if slots <= 0:
            return
        with transaction(self.sf) as s:
            candidates = list(
                s.scalars(
                    sa.select(Run.id)
                    .where(Run.state == RunState.queued.value)
                    .order_by(Run.created_at, Run.id)
                    .limit(max(10, slots * 4))
                )
            )
        if not candidates:
            return
        free = self.launcher.free_cpus()
        if free is not None:
            free -= sum(ex.demand_cpus for ex in self._executions.values() if not ex.started)
        for run_id in candidates:
            if slots <= 0:
                break
            launched = self._try_claim(run_id, free)
            if launched is not None:
                slots -= 1
                if free is not None:
                    free -= launched

    def _try_claim(self, run_id: int, free: float | None) -> float | None:
        """Claim one queued run and launch its pending attempt; returns its CPU demand, or None if not taken."""
        try:
            claimed = self._claim_one(run_id, free)
        except _NoRoom:
            return None  # rolled back: it stays queued and unclaimed for a later tick
        if claimed is None:
            return None
        number, demand = claimed
        self._launch(run_id, number)
        return demand

    def _claim_one(self, run_id: int, free: float | None) -> tuple[int, float] | None:
        with transaction(self.sf) as s:
            if not self._lock_run(s, run_id, Run.state == RunState.queued.value):
                return None
            run = s.get(Run, run_id, populate_existing=True)
            assert run is not None
            if run.cancel_requested:
                self._cancel_pending(s, run, "cancelled before it started")
                return None
            try:
                recipe = self._recipe(run)
            except RecipeError as exc:
                set_run_state(session=s, run=run, to=RunState.starting, reason=f"claimed by {self.id}")
                set_run_state(session=s, run=run, to=RunState.failed, reason=f"the stored recipe is invalid: {exc}")
                self._clear_claim(run)
                return None
            demand = recipe.resources.num_workers * recipe.resources.cpus_per_worker
            if free is not None and demand > free + 1e-9:
                raise _NoRoom()
            attempt = next((a for a in run.attempts if a.state == AttemptState.pending.value), None)
            if attempt is None:
                attempt = self._new_attempt(s, run, kind="initial" if not run.attempts else "manual",
                                            reason="initial attempt" if not run.attempts else "re-queued")
            run.current_attempt = attempt.number
            set_run_state(session=s, run=run, to=RunState.starting, reason=f"claimed by scheduler {self.id}",
                          data={"attempt": attempt.number})
            return attempt.number, demand

    # ----------------------------------------------------------------------------------------- launch
    def _recipe(self, run: Run) -> Recipe:
        """The run's stored recipe (its import strings were admitted at submission)."""
        parsed = run.recipe.parsed
        modules = list(self.settings.allowed_import_modules)
        for section in ("model", "data"):
            part = parsed.get(section)
            if isinstance(part, dict) and part.get("name") == "custom" and isinstance(part.get("factory"), str):
                modules.append(part["factory"].split(":", 1)[0])
        return validate_recipe_data(parsed, allowed_import_modules=modules)

    def _allowed_modules(self, recipe: Recipe) -> list[str]:
        mods = list(self.settings.allowed_import_modules)
        for part in (recipe.model, recipe.data):
            if isinstance(part, CustomModel | CustomData):
                mods.append(part.factory.split(":", 1)[0])
        return sorted(set(mods))

    def _resume_uri(self, s: Session, attempt: Attempt) -> str | None:
        uri = (attempt.plan or {}).get("resume_uri")
        if uri:
            return str(uri)
        if attempt.parent_checkpoint_id is not None:
            row = s.get(CheckpointRow, attempt.parent_checkpoint_id)
            if row is not None:
                return row.uri
        return None

    def _spec_dict(self, s: Session, run: Run, attempt: Attempt) -> dict[str, Any]:
        """The attempt's ``AttemptSpec`` (effective recipe, resume point, plan) as the workers receive it."""
        recipe = self._recipe(run)
        eff = effective_recipe(recipe, attempt.overrides or {})
        plan = attempt.plan or {}
        spec = AttemptSpec(
            recipe=eff,
            checkpoint_dir=_join(self.settings.checkpoint_root, f"run-{run.id}", f"attempt-{attempt.number}"),
            attempt=attempt.number,
            resume_from=self._resume_uri(s, attempt),
            rewarm_steps=int(plan.get("rewarm_steps") or 0),
            data_offset=int(plan.get("data_offset") or 0),
            run_id=run.id,
            allowed_import_modules=self._allowed_modules(recipe),
        )
        return spec.to_dict()

    def _launch(self, run_id: int, number: int) -> None:
        """Start a worker group for the run's pending attempt ``number`` (committing the names first)."""
        try:
            with transaction(self.sf) as s:
                run = s.get(Run, run_id, populate_existing=True)
                assert run is not None
                attempt = _attempt(run, number)
                spec = self._spec_dict(s, run, attempt)
                recipe = self._recipe(run)
                name = f"ballast-r{run.id}-a{number}-{uuid.uuid4().hex[:8]}"
                run_name = f"run-{run.id}-attempt-{number}"
                attempt.ray_info = {
                    **(attempt.ray_info or {}),
                    "channel": name,
                    "namespace": NAMESPACE,
                    "run_name": run_name,
                    "storage_path": self.settings.checkpoint_root,
                    "scheduler": self.id,
                }
                if run.state == RunState.recovering.value:
                    set_run_state(session=s, run=run, to=RunState.starting,
                                  reason=f"starting attempt {number}", data={"attempt": number})
                res = recipe.resources
                launch = {
                    "spec": spec,
                    "attempt": number,
                    "run_name": run_name,
                    "storage_path": self.settings.checkpoint_root,
                    "checkpoint_uri_prefix": _join(self.settings.checkpoint_root, run_name),
                    "num_workers": res.num_workers,
                    "cpus_per_worker": res.cpus_per_worker,
                    "use_gpu": res.use_gpu,
                    "gpus_per_worker": res.gpus_per_worker,
                }
                if self.train_fn:
                    launch["train_fn"] = self.train_fn
                demand = res.num_workers * res.cpus_per_worker
        except Exception as exc:  # noqa: BLE001 - a spec the engine refuses is the run's failure, not ours
            log.exception("run %s: cannot build attempt %s", run_id, number)
            self._fail_start(run_id, number, f"attempt {number} could not be prepared: {_one_line(exc)}")
            return
        try:
            handle = self.launcher.launch(name=name, run_id=run_id, attempt=number, launch=launch)
        except Exception as exc:  # noqa: BLE001 - Ray refused: the run cannot start
            log.exception("run %s: launching attempt %s failed", run_id, number)
            self._fail_start(run_id, number, f"attempt {number} could not start on Ray: {_one_line(exc)}")
            return
        self._executions[run_id] = _Execution(run_id=run_id, name=name, handle=handle, attempt=number,
                                              demand_cpus=demand)
        log.info("run %s: attempt %s launched as %s", run_id, number, name)

    def _fail_start(self, run_id: int, number: int, reason: str) -> None:
        with transaction(self.sf) as s:
            run = s.get(Run, run_id, populate_existing=True)
            if run is None or run.state in TERMINAL_RUN_STATES:
                return
            attempt = _attempt(run, number)
            if attempt.state not in TERMINAL_ATTEMPT_STATES:
                attempt.outcome = {"outcome": "crashed", "error": reason}
                set_attempt_state(session=s, attempt=attempt, to=AttemptState.crashed, reason=reason)
            if run.state == RunState.recovering.value:
                set_run_state(session=s, run=run, to=RunState.starting, reason=reason)
            set_run_state(session=s, run=run, to=RunState.failed, reason=reason)
            self._clear_claim(run)

    # ---------------------------------------------------------------------------------------- service
    def _service(self, ex: _Execution) -> None:
        """Drain one worker group into the store and act on what happened."""
        acked = self._acked(ex.run_id)
        lost: str | None = None
        try:
            polled = self.launcher.poll(ex.handle, acked)
        except ChannelLost as exc:
            lost = str(exc)
            polled = {"events": [], "plan_requests": [], "fit": {"state": "failed", "error": lost}}
        if polled is None:
            return
        answers: list[tuple[int, dict[str, Any] | None]] = []
        send_stop = kill = False
        launch_next: int | None = None
        doomed: list[str] = []
        with transaction(self.sf) as s:
            run = s.get(Run, ex.run_id, populate_existing=True)
            if run is None or run.claimed_by != self.id:
                log.warning("run %s: no longer claimed by this scheduler; letting go", ex.run_id)
                self._executions.pop(ex.run_id, None)
                return
            if run.state in TERMINAL_RUN_STATES:
                self._executions.pop(ex.run_id, None)
                kill = True
            else:
                new_checkpoints = self._ingest(s, run, ex, polled.get("events") or [])
                if new_checkpoints:
                    doomed = self._retention(s, run)
                current_number = ex.attempt
                for req in polled.get("plan_requests") or []:
                    plan = self._in_place(s, run, current_number, ex.name, req)
                    answers.append((int(req["attempt"]), plan))
                    if plan is not None:
                        current_number = int(plan["attempt"])
                fit_state = polled["fit"]["state"]
                current = _attempt(run, current_number)
                if run.state in TERMINAL_RUN_STATES:
                    kill = True  # the policy gave up during an in-place request
                elif run.cancel_requested and fit_state == "running":
                    ended = (current.outcome or {}).get("outcome") == "cancelled"
                    overdue = ex.stop_sent_at is not None and time.monotonic() - ex.stop_sent_at > CANCEL_GRACE_S
                    if ended or overdue:
                        self._conclude(s, run, current, "cancelled",
                                       None if ended else "killed: the workers did not stop in time")
                        kill = True
                    elif ex.stop_sent_at is None:
                        send_stop = True
                elif fit_state in ("done", "failed"):
                    launch_next = self._worker_group_ended(s, run, current, fit_state, polled["fit"].get("error"))
                    kill = True
                if kill:
                    self._executions.pop(ex.run_id, None)
                    if run.state in TERMINAL_RUN_STATES:
                        self._clear_claim(run)
        for attempt, plan in answers:  # committed: now the workers may go on
            if plan is not None:
                ex.attempt = int(plan["attempt"])
            self.launcher.answer_plan(ex.handle, attempt, plan)
        if send_stop:
            self.launcher.request_stop(ex.handle)
            ex.stop_sent_at = time.monotonic()
        if kill and lost is None:
            self.launcher.kill(ex.handle)
        _remove_checkpoint_dirs(doomed, self.settings.checkpoint_root)
        if launch_next is not None:
            self._launch(ex.run_id, launch_next)

    def _acked(self, run_id: int) -> dict[int, int]:
        with transaction(self.sf) as s:
            rows = s.execute(sa.select(Attempt.number, Attempt.last_seq).where(Attempt.run_id == run_id)).all()
        return {int(n): int(seq or 0) for n, seq in rows}

    def _ingest(self, s: Session, run: Run, ex: _Execution, events: Sequence[Mapping[str, Any]]) -> bool:
        by_attempt: dict[int, list[Mapping[str, Any]]] = {}
        for ev in events:
            by_attempt.setdefault(int(ev.get("attempt", ex.attempt)), []).append(ev)
        new_checkpoints = False
        for number, evs in sorted(by_attempt.items()):
            attempt = next((a for a in run.attempts if a.number == number), None)
            if attempt is None:
                log.warning("run %s: %d events for unknown attempt %s dropped", run.id, len(evs), number)
                continue
            result = ingest_events(session=s, run=run, attempt=attempt, events=evs,
                                   metrics_every_steps=self.settings.metrics_every_steps)
            new_checkpoints = new_checkpoints or result.checkpoints > 0
            if attempt.state == AttemptState.pending.value:
                set_attempt_state(session=s, attempt=attempt, to=AttemptState.running, reason="workers started")
            if number == ex.attempt:
                ex.started = True
                if run.state == RunState.starting.value:
                    set_run_state(session=s, run=run, to=RunState.running, reason=f"attempt {number} running",
                                  data={"attempt": number})
        return new_checkpoints

    # ---------------------------------------------------------------------------------------- outcomes
    def _worker_group_ended(
        self, s: Session, run: Run, current: Attempt, fit_state: str, error: str | None
    ) -> int | None:
        """The fit returned or failed: map the current attempt's end onto the store; the next attempt or None."""
        if current.state in TERMINAL_ATTEMPT_STATES:
            return None
        end = current.outcome if current.outcome and "outcome" in current.outcome else None
        if run.cancel_requested or (end is not None and end.get("outcome") == "cancelled"):
            self._conclude(s, run, current, "cancelled", None)
            return None
        if end is not None and end.get("outcome") in ("succeeded", "diverged"):
            outcome, err = str(end["outcome"]), None
        else:
            outcome = "crashed"
            err = error if fit_state == "failed" and error else (
                "the worker group exited without reporting how the attempt ended")
        return self._conclude(s, run, current, outcome, err)

    def _conclude(self, s: Session, run: Run, attempt: Attempt, outcome: str, error: str | None) -> int | None:
        """End ``attempt`` with ``outcome``; end the run or record the next attempt (returned for launch)."""
        data = dict(attempt.outcome or {})
        data["outcome"] = outcome
        if error:
            data["error"] = summarize_error(error)
            if data["error"] != error.strip():
                data["error_detail"] = error
        attempt.outcome = jsonable(data)
        summary = _summary(attempt, data)
        if attempt.state == AttemptState.pending.value and outcome in ("succeeded", "diverged"):
            set_attempt_state(session=s, attempt=attempt, to=AttemptState.running, reason="workers started")
        if attempt.state not in TERMINAL_ATTEMPT_STATES:
            set_attempt_state(session=s, attempt=attempt, to=OUTCOME_STATE[outcome], reason=summary,
                              data={k: data.get(k) for k in ("final_step", "onset_step", "detector") if k in data})
        if outcome == "cancelled" or run.cancel_requested:
            set_run_state(session=s, run=run, to=RunState.cancelled, reason="cancelled on request")
            return None
        if outcome == "succeeded":
            if run.state == RunState.starting.value:
                set_run_state(session=s, run=run, to=RunState.running, reason=summary)
            set_run_state(session=s, run=run, to=RunState.succeeded, reason=summary)
            return None
        if outcome == "crashed":
            self._note_corrupt_parent(s, attempt, error)
        return self._recover(s, run, summary)

    def _recover(self, s: Session, run: Run, summary: str) -> int | None:
        """Ask the policy after a diverged/crashed attempt; record the decision. Returns the attempt to launch."""
        if run.state == RunState.running.value:
            set_run_state(session=s, run=run, to=RunState.recovering, reason=summary)
        decision = self._decide(s, run)
        if isinstance(decision, GiveUp):
            set_run_state(session=s, run=run, to=RunState.failed, reason=decision.reason)
            return None
        attempt = self._attempt_from_plan(s, run, decision)
        if run.state == RunState.starting.value:
            # it never got running (died while starting): wait in the queue for room like any run
            set_run_state(session=s, run=run, to=RunState.queued, reason=decision.reason,
                          data={"attempt": attempt.number})
            self._clear_claim(run)
            return None
        return attempt.number

    def _decide(self, s: Session, run: Run) -> RecoveryPlan | GiveUp:
        """``recovery.decide`` over the store's history; a chosen checkpoint that fails verification is marked
        corrupt and the policy asked again (it then picks the previous one)."""
        try:
            recipe = self._recipe(run)
        except RecipeError as exc:
            return GiveUp(f"the stored recipe is invalid: {exc}")
        for _ in range(MAX_POLICY_ROUNDS):
            history = [_attempt_record(a) for a in run.attempts if a.state in TERMINAL_ATTEMPT_STATES]
            rows = list(s.scalars(sa.select(CheckpointRow).where(CheckpointRow.run_id == run.id)
                                  .order_by(CheckpointRow.id)))
            numbers = {a.id: a.number for a in run.attempts}
            checkpoints = [_checkpoint_record(r, numbers.get(r.attempt_id, 0)) for r in rows]
            try:
                decision = decide(recipe, history, checkpoints)
            except (ValueError, RecipeError) as exc:
                return GiveUp(f"the recovery policy could not decide: {_one_line(exc)}")
            if isinstance(decision, RecoveryPlan) and decision.resume_from is not None:
                row = s.get(CheckpointRow, decision.resume_from.id)
                problem = verify_checkpoint(row.uri, row.sha256) if row is not None else "missing"
                if problem is not None and row is not None:
                    log.warning("run %s: checkpoint %s is unusable: %s", run.id, row.uri, problem)
                    row.verdict = {**(row.verdict or {}), "corrupt": problem}
                    s.flush()
                    continue
            return decision
        return GiveUp("no usable checkpoint: every candidate failed verification")

    def _attempt_from_plan(self, s: Session, run: Run, plan: RecoveryPlan) -> Attempt:
        attempt = self._new_attempt(s, run, kind=plan.kind, reason=plan.reason)
        attempt.parent_checkpoint_id = plan.parent_checkpoint_id
        attempt.resume_step = plan.resume_step
        attempt.overrides = jsonable(plan.overrides_json())
        attempt.plan = jsonable(plan.plan_json())
        if plan.kind == "numeric_retry":
            run.retries_used += 1
        elif plan.kind == "crash_restart":
            run.crash_restarts_used += 1
        run.current_attempt = attempt.number
        s.flush()
        return attempt

    def _new_attempt(self, s: Session, run: Run, *, kind: str, reason: str) -> Attempt:
        number = max((a.number for a in run.attempts), default=0) + 1
        attempt = Attempt(run_id=run.id, number=number, state=AttemptState.pending.value, kind=kind,
                          resume_step=0, overrides={}, plan={}, reason=reason, ray_info={})
        run.attempts.append(attempt)
        s.flush()
        return attempt

    def _note_corrupt_parent(self, s: Session, attempt: Attempt, error: str | None) -> None:
        """A crash while loading the checkpoint it resumed from marks that checkpoint corrupt."""
        if not error or attempt.parent_checkpoint_id is None:
            return
        if "CorruptCheckpoint" in error or "corrupt checkpoint" in error:
            row = s.get(CheckpointRow, attempt.parent_checkpoint_id)
            if row is not None:
                row.verdict = {**(row.verdict or {}), "corrupt": _one_line(error)}

    def _cancel_pending(self, s: Session, run: Run, reason: str) -> None:
        for a in run.attempts:
            if a.state not in TERMINAL_ATTEMPT_STATES:
                set_attempt_state(session=s, attempt=a, to=AttemptState.cancelled, reason=reason)
        set_run_state(session=s, run=run, to=RunState.cancelled, reason=reason)
        self._clear_claim(run)

    def _clear_claim(self, run: Run) -> None:
        run.claimed_by = None
        run.lease_expires_at = None

    # -------------------------------------------------------------------------------- in-place recovery
    def _in_place(
        self, s: Session, run: Run, current: int, channel: str, req: Mapping[str, Any]
    ) -> dict[str, Any] | None:
        """Rank 0 of a diverged attempt asks for the next attempt inside the same worker group.

        Returns the plan for the workers (``{"attempt", "spec", "reason"}``) or None, which ends the worker
        group: the normal path then restarts it (or the run has failed, when the policy gave up here)."""
        number = int(req["attempt"])
        if number != current or run.cancel_requested:
            return None
        attempt = _attempt(run, number)
        if attempt.state in TERMINAL_ATTEMPT_STATES:
            return None
        if not (attempt.outcome or {}).get("outcome"):
            ingest_events(session=s, run=run, attempt=attempt,
                          events=[{"seq": attempt.last_seq, "type": "end", "data": dict(req.get("end") or {})}])
        if (attempt.outcome or {}).get("outcome") != "diverged":
            return None
        try:
            eff = effective_recipe(self._recipe(run), attempt.overrides or {})
        except RecipeError:
            return None
        if not eff.recovery.in_place:
            return None
        if attempt.state == AttemptState.pending.value:
            set_attempt_state(session=s, attempt=attempt, to=AttemptState.running, reason="workers started")
        if run.state == RunState.starting.value:
            set_run_state(session=s, run=run, to=RunState.running, reason=f"attempt {number} running")
        next_number = self._conclude(s, run, attempt, "diverged", None)
        if next_number is None:
            return None
        new = _attempt(run, next_number)
        try:
            spec = self._spec_dict(s, run, new)
        except Exception as exc:  # noqa: BLE001 - fall back to a full restart, which reports the problem
            log.warning("run %s: in-place spec failed (%s); restarting the worker group", run.id, exc)
            return None
        new.plan = {**(new.plan or {}), "in_place": True}
        new.ray_info = {**(attempt.ray_info or {}), "in_place": True}
        set_attempt_state(session=s, attempt=new, to=AttemptState.running,
                          reason=f"continues in place in worker group {channel}")
        set_run_state(session=s, run=run, to=RunState.running, reason=new.reason,
                      data={"attempt": new.number, "in_place": True})
        return {"attempt": new.number, "spec": spec, "reason": new.reason}

    # --------------------------------------------------------------------------------------- retention
    def _retention(self, s: Session, run: Run) -> list[str]:
        """Keep the newest ``checkpoint.keep`` (by write order) plus the newest healthy; mark the rest
        deleted. Returns the directories to remove once committed (never one a live row still names)."""

        try:
            recipe = self._recipe(run)
        except RecipeError:
            return []
        rows = list(s.scalars(sa.select(CheckpointRow)
                              .where(CheckpointRow.run_id == run.id, CheckpointRow.deleted.is_(False))
                              .order_by(CheckpointRow.id)))
        in_use = {a.parent_checkpoint_id for a in run.attempts if a.state not in TERMINAL_ATTEMPT_STATES}
        entries = [(i, r.healthy and not (r.verdict or {}).get("corrupt")) for i, r in enumerate(rows)]
        doomed = [rows[i] for i in checkpoints_to_delete(entries, keep=recipe.checkpoint.keep,
                                                          keep_healthy=recipe.checkpoint.keep_healthy)]
        doomed = [r for r in doomed if r.id not in in_use]
        for r in doomed:
            r.deleted = True
        live_uris = {r.uri for r in rows if not r.deleted}
        s.flush()
        return sorted({r.uri for r in doomed if r.uri and r.uri not in live_uris})

    # -------------------------------------------------------------------------------------- reconcile
    def _reconcile(self) -> None:
        """Adopt active runs nobody drives: a lapsed lease, or an owner on this host that has died."""
        now = utcnow()
        with transaction(self.sf) as s:
            rows = s.execute(
                sa.select(Run.id, Run.claimed_by, Run.lease_expires_at)
                .where(Run.state.in_([st.value for st in ACTIVE_RUN_STATES]))
            ).all()
        for run_id, claimed_by, lease in rows:
            if run_id in self._executions:
                continue
            expired = lease is None or lease < now
            if not (expired or claimed_by == self.id or _owner_is_dead_here(claimed_by)):
                continue
            try:
                self._adopt(run_id, claimed_by)
            except Exception:  # noqa: BLE001 - try the others; this one is retried next round
                log.exception("adopting run %s failed", run_id)

    def _adopt(self, run_id: int, seen_owner: str | None) -> None:
        launch_next: int | None = None
        attached: _Execution | None = None
        with transaction(self.sf) as s:
            owner_cond = Run.claimed_by.is_(None) if seen_owner is None else Run.claimed_by == seen_owner
            if not self._lock_run(s, run_id, Run.state.in_([st.value for st in ACTIVE_RUN_STATES]), owner_cond):
                return
            run = s.get(Run, run_id, populate_existing=True)
            assert run is not None
            latest = max(run.attempts, key=lambda a: a.number, default=None)
            log.info("run %s: adopting (was claimed by %s)", run_id, seen_owner)
            if latest is None:
                set_run_state(session=s, run=run, to=RunState.failed, reason="active run without an attempt")
                self._clear_claim(run)
                return
            if latest.state in TERMINAL_ATTEMPT_STATES:
                # the previous scheduler died between ending an attempt and recording the next one
                if run.state == RunState.running.value or run.state == RunState.recovering.value:
                    outcome = latest.state
                    if outcome in ("succeeded", "cancelled"):
                        set_run_state(session=s, run=run, to=RunState(outcome),
                                      reason=_summary(latest, latest.outcome or {}))
                        self._clear_claim(run)
                        return
                    launch_next = self._recover(s, run, _summary(latest, latest.outcome or {}))
                else:  # starting with a finished attempt: cannot happen through this scheduler; fail visibly
                    set_run_state(session=s, run=run, to=RunState.failed,
                                  reason=f"attempt {latest.number} ended before the run started")
                    self._clear_claim(run)
            else:
                name = (latest.ray_info or {}).get("channel")
                handle = self.launcher.attach(str(name)) if name else None
                if handle is not None:
                    recipe = self._recipe(run)
                    attached = _Execution(
                        run_id=run_id, name=str(name), handle=handle, attempt=latest.number,
                        demand_cpus=recipe.resources.num_workers * recipe.resources.cpus_per_worker,
                        started=latest.state == AttemptState.running.value,
                    )
                    if run.cancel_requested:
                        attached.stop_sent_at = None
                elif latest.state == AttemptState.pending.value:
                    launch_next = latest.number  # it never started: start it now
                    if run.state == RunState.running.value:
                        set_run_state(session=s, run=run, to=RunState.recovering, reason="restarting the worker group")
                elif run.cancel_requested:
                    self._conclude(s, run, latest, "cancelled", None)
                    self._clear_claim(run)
                else:
                    launch_next = self._conclude(
                        s, run, latest, "crashed",
                        "the worker group was lost while the control plane was down (its Ray work is gone)",
                    )
                    if run.state in TERMINAL_RUN_STATES:
                        self._clear_claim(run)
        if attached is not None:
            self._executions[run_id] = attached
            log.info("run %s: reattached to %s", run_id, attached.name)
        elif launch_next is not None:
            self._launch(run_id, launch_next)


# ------------------------------------------------------------------------------------------- helpers
def _attempt(run: Run, number: int) -> Attempt:
    for a in run.attempts:
        if a.number == number:
            return a
    raise LookupError(f"run {run.id} has no attempt {number}")


def _float(x: Any) -> float | None:
    if isinstance(x, str):
        return {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}.get(x)
    return None if x is None else float(x)


def _attempt_record(a: Attempt) -> AttemptRecord:
    o = a.outcome or {}
    final = o.get("final_step", a.last_step)
    return AttemptRecord(
        number=a.number,
        kind=a.kind if a.kind in ATTEMPT_KINDS else "initial",
        outcome=a.state,
        start_step=a.resume_step or 0,
        onset_step=a.onset_step,
        final_step=int(final) if final is not None else None,
        detector=o.get("detector"),
        value=_float(o.get("value")),
        overrides=dict(a.overrides or {}),
        data_offset=int((a.plan or {}).get("data_offset") or 0),
        loss_scale_collapsed=bool(o.get("loss_scale_collapsed", False)),
        median_grad_norm=finite_or_none(o.get("median_grad_norm")),
        error=o.get("error"),
        resumed_from_id=a.parent_checkpoint_id,
    )


def _checkpoint_record(r: CheckpointRow, attempt_number: int) -> CheckpointRecord:
    return CheckpointRecord(
        id=r.id, attempt_number=attempt_number, step=r.step, uri=r.uri, healthy=r.healthy,
        valid=not r.deleted and not (r.verdict or {}).get("corrupt"),
    )


def _summary(attempt: Attempt, data: Mapping[str, Any]) -> str:
    """One line: how the attempt ended."""
    outcome = data.get("outcome", attempt.state)
    n = attempt.number
    if outcome == "succeeded":
        return f"attempt {n} succeeded at step {data.get('final_step', attempt.last_step)}"
    if outcome == "diverged":
        what = data.get("detector") or "anomaly"
        return f"attempt {n} diverged at step {data.get('onset_step', data.get('final_step'))} ({what})"
    if outcome == "crashed":
        return f"attempt {n} crashed: {_one_line(data.get('error'))}"
    return f"attempt {n} {outcome}"


_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Checkpoint|Crash|Interrupt|Exit)):\s*(.*)$")
_RANK_SNIPPET = re.compile(r"^\[Rank (\d+) Error Snippet\]:\s*$", re.MULTILINE)
_DIED = ("actor died unexpectedly", "worker process has died", "health check failed", "killed by")


def summarize_error(text: str | None) -> str:
    """The root cause of a failed worker group in one line.

    Ray Train's ``WorkerGroupError`` lists a snippet per rank; when one worker died, the others only report a
    broken connection, so the dead rank is the cause. Otherwise the first rank's exception line."""
    text = str(text or "").strip()
    if not text:
        return "no error recorded"
    parts = _RANK_SNIPPET.split(text)
    snippets = {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}
    for rank, body in sorted(snippets.items()):
        if any(marker in body for marker in _DIED):
            return f"worker rank {rank} died (its process exited: killed, out of memory or crashed)"
    for body in [snippets[r] for r in sorted(snippets)] or [text]:
        found = [m for m in (_EXC_LINE.match(ln.strip()) for ln in body.splitlines()) if m is not None]
        if found:
            name, msg = found[-1].group(1), found[-1].group(2)
            return _one_line(f"{name.rsplit('.', 1)[-1]}: {msg}" if msg else name)
    return _one_line(text)


def _one_line(text: Any, limit: int = 300) -> str:
    lines = [ln.strip() for ln in str(text or "").splitlines() if ln.strip()]
    if not lines:
        return "no details"
    line = lines[-1] if lines[0].startswith("Traceback") else lines[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def verify_checkpoint(uri: str, sha256: str | None) -> str | None:
    """Why a checkpoint cannot be resumed from, or None if it can (or cannot be checked from here).

    Local directories are verified fully (manifest checksum, recorded digest, every file's size and sha256),
    so a corrupt newest checkpoint costs no failed attempt. Remote URIs are left to the worker's verified load.
    """
    path = local_dir(uri)
    if path is None:
        return None
    try:
        contracts_checkpoint.verify_checkpoint(path, expected_sha256=sha256 or None)
    except CorruptCheckpoint as exc:
        return exc.reason
    return None


def _remove_checkpoint_dirs(uris: Sequence[str], root: str) -> None:
    """Delete retired checkpoint directories, only ever under the checkpoint root."""
    for uri in uris:
        if not uri.startswith(root.rstrip("/") + "/"):
            log.warning("not deleting %s: outside the checkpoint root %s", uri, root)
            continue
        local = local_dir(uri)
        try:
            if local is not None:
                shutil.rmtree(local, ignore_errors=True)
            else:
                import pyarrow.fs as pafs

                fs, path = pafs.FileSystem.from_uri(uri)
                fs.delete_dir(path)
        except Exception as exc:  # noqa: BLE001 - a leftover directory is not worth failing a run over
            log.warning("could not delete checkpoint %s: %s", uri, exc)


@contextlib.contextmanager
def _signals_stop(scheduler: Scheduler) -> Iterator[None]:
    def _handler(signum: int, _frame: FrameType | None) -> None:
        scheduler.stop()

    previous = {sig: signal.signal(sig, _handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(settings: Settings | None = None) -> None:
    """Run the scheduler alone in the foreground until SIGINT/SIGTERM (``ballast scheduler`` uses the class
    directly; this is for ``python -m orchestrator.scheduler``)."""
    from orchestrator.settings import get_settings
    from orchestrator.store.db import make_engine, make_session_factory

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    settings = settings or get_settings()
    factory = make_session_factory(make_engine(settings.database_url))
    scheduler = Scheduler(settings, factory, os.environ.get("BALLAST_SCHEDULER_ID") or None)
    with _signals_stop(scheduler):
        scheduler.run_forever()


if __name__ == "__main__":
    main()
