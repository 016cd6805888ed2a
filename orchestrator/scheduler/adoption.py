"""Adopting active runs that nobody drives (a lapsed lease, or an owner on this host that has died): reattach to
their channel actor when their Ray work still runs (a detached actor outlives the scheduler that started it), else
finish what the dead scheduler left half done: start a never-started attempt, record a lost worker group as a
crash and resume per policy, or act on an attempt that had ended before the next step was recorded. Whenever the
Ray work is gone, checkpoint storage is reconciled with the store first (``storage``): the checkpoints written
after the last drain are resumed from, not recomputed, and nothing is left on storage that retention would not
keep."""

from __future__ import annotations

import logging
import time

import sqlalchemy as sa
from sqlalchemy.orm import Session

from orchestrator.policy.rules import Decision, Happening, Note, Situation, Why, resolve
from orchestrator.policy.states import ACTIVE_RUN_STATES, TERMINAL_ATTEMPT_STATES, AttemptState, RunState
from orchestrator.scheduler.claims import lock_run, owner_is_dead_here
from orchestrator.scheduler.context import Context, Execution, cpu_demand, release_if_done
from orchestrator.scheduler.failures import Failure
from orchestrator.scheduler.launching import launch
from orchestrator.scheduler.outage import is_outage
from orchestrator.scheduler.outcomes import RECOVERABLE, FollowUp, conclude, follow_up, summary, workers_started
from orchestrator.scheduler.retention import remove_checkpoint_dirs, retire_checkpoints
from orchestrator.scheduler.storage import reconcile_storage
from orchestrator.store.db import transaction
from orchestrator.store.models import Attempt, CheckpointRow, Run, utcnow
from orchestrator.store.transitions import apply_transitions

log = logging.getLogger("ballast.scheduler")

LOST = "the worker group was lost while the control plane was down (its Ray work is gone)"


def reconcile(ctx: Context) -> None:
    """Adopt active runs nobody drives: a lapsed lease, or an owner on this host that has died."""
    now = utcnow()
    with transaction(ctx.sf) as s:
        rows = s.execute(
            sa.select(Run.id, Run.claimed_by, Run.lease_expires_at)
            .where(Run.state.in_([st.value for st in ACTIVE_RUN_STATES]))
        ).all()
    for run_id, claimed_by, lease in rows:
        if run_id in ctx.executions:
            continue
        expired = lease is None or lease < now
        if not (expired or claimed_by == ctx.id or owner_is_dead_here(claimed_by)):
            continue
        try:
            adopt(ctx, run_id, claimed_by)
        except Exception as exc:  # noqa: BLE001 - try the others; this one is retried next round
            if is_outage(exc):
                raise  # the whole tick failed: logged once, by the loop
            log.exception("adopting run %s failed", run_id)


def adopt(ctx: Context, run_id: int, seen_owner: str | None) -> None:
    launch_next: int | None = None
    attached: Execution | None = None
    doomed: list[str] = []
    with transaction(ctx.sf) as s:
        owner_cond = Run.claimed_by.is_(None) if seen_owner is None else Run.claimed_by == seen_owner
        if not lock_run(ctx, s, run_id, Run.state.in_([st.value for st in ACTIVE_RUN_STATES]), owner_cond):
            return
        run = s.get(Run, run_id, populate_existing=True)
        assert run is not None
        latest = max(run.attempts, key=lambda a: a.number, default=None)
        log.info("run %s: adopting (was claimed by %s)", run_id, seen_owner)
        if latest is None:
            empty = resolve(Situation(Happening.ADOPTED_EMPTY, run=RunState(run.state)))
            apply_transitions(session=s, resolution=empty, run=run,
                              notes={Why.EVENT: Note("active run without an attempt")})
            release_if_done(run)
        elif latest.state in TERMINAL_ATTEMPT_STATES:
            # the previous scheduler died between ending an attempt and recording the next one
            launch_next = _after_an_end(ctx, s, run, latest, doomed)
        else:
            attached, launch_next = _unended(ctx, s, run, latest, doomed)
    remove_checkpoint_dirs(doomed, ctx.settings.checkpoint_root)
    if attached is not None:
        ctx.executions[run_id] = attached
        log.info("run %s: reattached to %s", run_id, attached.name)
    elif launch_next is not None:
        launch(ctx, run_id, launch_next)


def _after_an_end(ctx: Context, s: Session, run: Run, latest: Attempt, doomed: list[str]) -> int | None:
    outcome = AttemptState(latest.state)
    starting = run.state == RunState.starting.value
    follow = FollowUp()
    doomed += reconcile_storage(ctx, s, run)
    if outcome in RECOVERABLE and not starting:
        follow = follow_up(ctx, s, run, latest)
    # a starting run with a finished attempt cannot happen through this scheduler: it fails visibly
    said = f"attempt {latest.number} ended before the run started" if starting else summary(latest)
    after = resolve(Situation(Happening.ADOPTED_ENDED, run=RunState(run.state), outcome=outcome,
                              decision=follow.decision))
    apply_transitions(session=s, resolution=after, run=run, next_attempt=follow.attempt,
                      notes={Why.EVENT: Note(said), **follow.notes})
    if follow.decision is not Decision.GIVE_UP:  # as before: a run given up here keeps its claim (lease lapses)
        release_if_done(run)
    doomed += retire_checkpoints(ctx, s, run)
    return follow.attempt.number if after.launch and follow.attempt is not None else None


def _unended(ctx: Context, s: Session, run: Run, latest: Attempt,
             doomed: list[str]) -> tuple[Execution | None, int | None]:
    """Reattach to the newest attempt's worker group if it still runs. Else its Ray work is gone: the checkpoints
    the store missed are recorded from storage first (so the policy resumes from the newest one there), then the
    attempt is started (it never ran: no checkpoint of it anywhere), or recorded cancelled (on request) or crashed;
    retention runs after the decision. ``(execution, attempt to launch)``."""
    name = (latest.ray_info or {}).get("channel")
    handle = ctx.launcher.attach(str(name)) if name else None
    if handle is not None:
        running = latest.state == AttemptState.running.value
        # a running attempt's step deadline counts from the reattachment (a group hung meanwhile emits nothing)
        return Execution(run_id=run.id, name=str(name), handle=handle, attempt=latest.number,
                         demand_cpus=cpu_demand(ctx.recipe(run)), started=running,
                         progress_at=time.monotonic() if running else None), None
    doomed += reconcile_storage(ctx, s, run)
    ran = s.scalar(sa.select(sa.func.count()).select_from(CheckpointRow)
                   .where(CheckpointRow.attempt_id == latest.id)) or 0
    if latest.state == AttemptState.pending.value and not ran:
        unstarted = resolve(Situation(Happening.ADOPTED_UNSTARTED, run=RunState(run.state)))
        apply_transitions(session=s, resolution=unstarted, run=run,
                          notes={Why.EVENT: Note("restarting the worker group")})
        return None, latest.number
    if latest.state == AttemptState.pending.value:  # it ran, but none of its events reached the store
        workers_started(s, run, latest, current=True,
                        note=Note(f"attempt {latest.number} had run: its checkpoints are on storage"))
    if run.cancel_requested:
        conclude(ctx, s, run, latest, AttemptState.cancelled)
        launch_next = None
    else:
        launch_next = conclude(ctx, s, run, latest, AttemptState.crashed, Failure(LOST)).to_launch
    doomed += retire_checkpoints(ctx, s, run)
    return None, launch_next
