"""Who owns a run: the scheduler's identity, leases, dialect-aware locking, and claiming queued runs.

On PostgreSQL a run is taken with ``SELECT ... FOR UPDATE SKIP LOCKED``, so several schedulers never claim the
same run; on SQLite (one machine) a conditional ``UPDATE ... WHERE`` does the same under SQLite's write lock. A
claim is ``runs.claimed_by = host:pid:nonce`` with ``lease_expires_at``, renewed every tick while the run is
active; a lapsed lease (or a dead owner on this host) lets another scheduler adopt the run.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import uuid
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from contracts.recipe import RecipeError
from orchestrator.policy.rules import Happening, Note, Situation, Why, resolve
from orchestrator.policy.states import AttemptState, RunState
from orchestrator.scheduler.context import Context, cannot_fit, clear_claim, cpu_demand
from orchestrator.scheduler.launching import launch
from orchestrator.scheduler.outcomes import new_attempt
from orchestrator.store.actions import cancel_queued_run
from orchestrator.store.db import transaction
from orchestrator.store.models import Run, utcnow
from orchestrator.store.transitions import apply_transitions

log = logging.getLogger("ballast.scheduler")


class NoRoom(Exception):
    """The cluster lacks the CPUs for this run now (aborts the claim's transaction)."""


def default_scheduler_id() -> str:
    """``host:pid:nonce``: lets a restarted scheduler on the same host see that the old owner is dead."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def owner_is_dead_here(claimed_by: str | None) -> bool:
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


# ------------------------------------------------------------------------------------------------- leases
def renew_leases(ctx: Context) -> None:
    if not ctx.executions:
        return
    with transaction(ctx.sf) as s:
        s.execute(
            sa.update(Run)
            .where(Run.id.in_(list(ctx.executions)), Run.claimed_by == ctx.id)
            .values(lease_expires_at=ctx.lease_until())
        )


def release_leases(ctx: Context) -> None:
    """On a clean stop: let another scheduler adopt our runs at once instead of after the lease."""
    if not ctx.executions:
        return
    with contextlib.suppress(Exception), transaction(ctx.sf) as s:
        s.execute(
            sa.update(Run)
            .where(Run.id.in_(list(ctx.executions)), Run.claimed_by == ctx.id)
            .values(lease_expires_at=utcnow())
        )
    ctx.executions.clear()


def lock_run(ctx: Context, s: Session, run_id: int, *conditions: Any) -> bool:
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
            sa.update(Run).where(Run.id == run_id).values(claimed_by=ctx.id, lease_expires_at=ctx.lease_until())
        )
        return True
    result = s.execute(
        sa.update(Run)
        .where(Run.id == run_id, *conditions)
        .values(claimed_by=ctx.id, lease_expires_at=ctx.lease_until())
    )
    return bool(getattr(result, "rowcount", 0))


# ------------------------------------------------------------------------------------------------- claims
def free_cpus(ctx: Context) -> float | None:
    """The cluster's free CPUs as a claim may count them: the launcher's, less those of the worker groups this
    scheduler launched that Ray has not placed yet (None: unknown)."""
    free = ctx.launcher.free_cpus()
    if free is not None:
        free -= sum(ex.demand_cpus for ex in ctx.executions.values() if not ex.started)
    return free


def claim(ctx: Context) -> None:
    """Claim queued runs (oldest first) while there is room: ``max_concurrent_runs`` and the cluster's CPUs."""
    slots = ctx.settings.max_concurrent_runs - len(ctx.executions)
    if slots <= 0:
        return
    with transaction(ctx.sf) as s:
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
    free = free_cpus(ctx)
    capacity = ctx.launcher.capacity()
    for run_id in candidates:
        if slots <= 0:
            break
        launched = _try_claim(ctx, run_id, free, capacity)
        if launched is not None:
            slots -= 1
            if free is not None:
                free -= launched


def _try_claim(ctx: Context, run_id: int, free: float | None,
               capacity: dict[str, float] | None = None) -> float | None:
    """Claim one queued run and launch its pending attempt; returns its CPU demand, or None if not taken."""
    try:
        claimed = _claim_one(ctx, run_id, free, capacity)
    except NoRoom:
        return None  # rolled back: it stays queued and unclaimed for a later tick
    if claimed is None:
        return None
    number, demand = claimed
    launch(ctx, run_id, number)
    return demand


def _claim_one(ctx: Context, run_id: int, free: float | None,
               capacity: dict[str, float] | None = None) -> tuple[int, float] | None:
    with transaction(ctx.sf) as s:
        if not lock_run(ctx, s, run_id, Run.state == RunState.queued.value):
            return None
        run = s.get(Run, run_id, populate_existing=True)
        assert run is not None
        if run.cancel_requested:
            cancel_queued_run(session=s, run=run, reason="cancelled before it started")
            clear_claim(run)
            return None
        try:
            recipe = ctx.recipe(run)
        except RecipeError as exc:
            broken = resolve(Situation(Happening.RECIPE_INVALID, run=RunState(run.state)))
            apply_transitions(session=s, resolution=broken, run=run, notes={
                Why.CLAIM: Note(f"claimed by {ctx.id}"), Why.EVENT: Note(f"the stored recipe is invalid: {exc}")})
            clear_claim(run)
            return None
        unfit = cannot_fit(recipe, capacity)
        if unfit is not None:
            _never_fits(ctx, s, run, unfit)
            return None
        demand = cpu_demand(recipe)
        if free is not None and demand > free + 1e-9:
            raise NoRoom()
        attempt = next((a for a in run.attempts if a.state == AttemptState.pending.value), None)
        if attempt is None:
            attempt = new_attempt(s, run, kind="initial" if not run.attempts else "manual",
                                  reason="initial attempt" if not run.attempts else "re-queued")
        run.current_attempt = attempt.number
        claimed = resolve(Situation(Happening.CLAIMED, run=RunState(run.state)))
        apply_transitions(session=s, resolution=claimed, run=run, notes={
            Why.EVENT: Note(f"claimed by scheduler {ctx.id}", {"attempt": attempt.number})})
        return attempt.number, demand


def _never_fits(ctx: Context, s: Session, run: Run, why: str) -> None:
    """A run bigger than the whole cluster says so at once: it fails with the reason, or, where an autoscaler can
    add nodes (``cluster_autoscales``), it stays queued (unclaimed) with the reason until it fits."""
    if ctx.settings.cluster_autoscales:
        waiting = f"waiting for the autoscaler: {why}"
        if run.reason != waiting:
            log.info("run %s: %s", run.id, waiting)
            run.reason = waiting
        clear_claim(run)
        return
    unfit = resolve(Situation(Happening.CANNOT_FIT, run=RunState(run.state)))
    apply_transitions(session=s, resolution=unfit, run=run, notes={
        Why.CLAIM: Note(f"claimed by {ctx.id}"), Why.EVENT: Note(f"cannot run on this cluster: {why}")})
    clear_claim(run)
