"""Servicing one worker group per tick: drain → effects → commit → execute.

1. **drain** the channel (events, open in-place plan requests, the fit's state); a lost channel reads as a
   failed fit;
2. work out the **effects** in one transaction: ingest the events, retire surplus checkpoints, answer plan
   requests (``handshake``), pass on a cancel, map an ended fit onto the attempt and the policy's next step;
3. **commit**, and only then
4. **execute** what the workers must be told (plan answers, stop, kill), remove retired checkpoint directories
   and launch the next worker group, so a scheduler that dies in between leaves a state the next one can finish.

A running attempt whose events stop for ``resources.step_timeout_s`` (the step-progress deadline) is ended as
crashed ("no step for N s (hung?)") and its worker group torn down; the crash path resumes it. Whenever a group is
over, its checkpoint storage is reconciled with the store first (``storage``), so the policy resumes from the
newest checkpoint on storage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from contracts.recipe import RecipeError
from orchestrator.policy.recovery import effective_recipe
from orchestrator.policy.rules import Note
from orchestrator.policy.states import TERMINAL_ATTEMPT_STATES, TERMINAL_RUN_STATES, AttemptState
from orchestrator.scheduler.context import Context, Execution, attempt_of
from orchestrator.scheduler.failures import Failure
from orchestrator.scheduler.handshake import answer_plan_request
from orchestrator.scheduler.launcher import ChannelLost
from orchestrator.scheduler.launching import launch
from orchestrator.scheduler.outcomes import (
    PREFLIGHT,
    conclude,
    record_preflight,
    worker_group_ended,
    workers_started,
)
from orchestrator.scheduler.retention import remove_checkpoint_dirs, retire_checkpoints
from orchestrator.scheduler.storage import reconcile_storage
from orchestrator.store.db import transaction
from orchestrator.store.ingest import ingest_events
from orchestrator.store.models import Attempt, Run
from orchestrator.store.records import StoredOutcome

log = logging.getLogger("ballast.scheduler")

CANCEL_GRACE_S = 7.0
"""After asking a worker group to stop, wait this long before killing it (the API promises 10 s)."""


@dataclass
class Effects:
    """What the tick must do once its transaction is committed."""

    answers: list[tuple[int, dict[str, Any] | None]] = field(default_factory=list)
    """In-place plan answers, per requesting attempt (None: end the worker group)."""
    send_stop: bool = False
    kill: bool = False
    launch: int | None = None
    """The attempt to start a new worker group for."""
    doomed: list[str] = field(default_factory=list)
    """Retired checkpoint directories to remove."""


def service(ctx: Context, ex: Execution) -> None:
    """Drain one worker group into the store and act on what happened."""
    polled, lost = _drain(ctx, ex)
    if polled is None:
        return
    with transaction(ctx.sf) as s:
        effects = _effects(ctx, s, ex, polled)
    if effects is not None:
        _execute(ctx, ex, effects, lost)


def _drain(ctx: Context, ex: Execution) -> tuple[dict[str, Any] | None, str | None]:
    """The channel's poll (None: busy, try next tick) and, when the channel is gone, why."""
    with transaction(ctx.sf) as s:
        rows = s.execute(sa.select(Attempt.number, Attempt.last_seq).where(Attempt.run_id == ex.run_id)).all()
    acked = {int(n): int(seq or 0) for n, seq in rows}
    try:
        return ctx.launcher.poll(ex.handle, acked), None
    except ChannelLost as exc:
        lost = str(exc)
        return {"events": [], "plan_requests": [], "fit": {"state": "failed", "error": lost}}, lost


def _effects(ctx: Context, s: Session, ex: Execution, polled: Mapping[str, Any]) -> Effects | None:
    run = s.get(Run, ex.run_id, populate_existing=True)
    if run is None or run.claimed_by != ctx.id:
        log.warning("run %s: no longer claimed by this scheduler; letting go", ex.run_id)
        ctx.executions.pop(ex.run_id, None)
        return None
    fx = Effects()
    if run.state in TERMINAL_RUN_STATES:
        ctx.executions.pop(ex.run_id, None)
        fx.kill = True
        return fx
    preflight = (polled.get("fit") or {}).get(PREFLIGHT)
    if isinstance(preflight, Mapping):
        record_preflight(attempt_of(run, ex.attempt), preflight)
    if _ingest(ctx, s, run, ex, polled.get("events") or []):
        fx.doomed = retire_checkpoints(ctx, s, run)
    current = ex.attempt
    for req in polled.get("plan_requests") or []:
        plan = answer_plan_request(ctx, s, run, current, ex.name, req)
        fx.answers.append((int(req["attempt"]), plan))
        if plan is not None:
            current = int(plan["attempt"])
    _act_on_fit(ctx, s, run, ex, attempt_of(run, current), polled["fit"], fx)
    if fx.kill:
        ctx.executions.pop(ex.run_id, None)
    return fx


def _act_on_fit(ctx: Context, s: Session, run: Run, ex: Execution, current: Attempt, fit: Mapping[str, Any],
                fx: Effects) -> None:
    state = fit["state"]
    if run.state in TERMINAL_RUN_STATES:
        fx.kill = True  # the policy gave up during an in-place request
    elif run.cancel_requested and state == "running":
        ended = StoredOutcome.read(current.outcome).verdict == AttemptState.cancelled.value
        overdue = ex.stop_sent_at is not None and time.monotonic() - ex.stop_sent_at > CANCEL_GRACE_S
        if ended or overdue:
            conclude(ctx, s, run, current, AttemptState.cancelled,
                     None if ended else Failure("killed: the workers did not stop in time"))
            fx.kill = True
        elif ex.stop_sent_at is None:
            fx.send_stop = True
    elif state in ("done", "failed"):
        # the group is over: what it wrote that never reached the store is recorded before the policy decides
        fx.doomed += reconcile_storage(ctx, s, run)
        fx.launch = worker_group_ended(ctx, s, run, current, fit).to_launch
        fx.doomed += retire_checkpoints(ctx, s, run)
        fx.kill = True
    elif state == "running" and (hang := _no_progress(ctx, run, ex, current)) is not None:
        log.warning("run %s: attempt %s: %s; tearing its worker group down", run.id, current.number, hang)
        fx.doomed += reconcile_storage(ctx, s, run)
        fx.launch = conclude(ctx, s, run, current, AttemptState.crashed, Failure(hang)).to_launch
        fx.doomed += retire_checkpoints(ctx, s, run)
        fx.kill = True


def _no_progress(ctx: Context, run: Run, ex: Execution, current: Attempt) -> str | None:
    """Why the current attempt counts as hung (the step-progress deadline, ``resources.step_timeout_s``, passed
    since its last events), or None. The clock starts with the attempt's first events: a group that never gets
    that far is bounded by its collective timeout (the rendezvous), which the deadline also sets."""
    if ex.progress_at is None or current.state in TERMINAL_ATTEMPT_STATES:
        return None
    try:
        timeout = effective_recipe(ctx.recipe(run), current.overrides or {}).resources.step_timeout_s
    except RecipeError:
        return None
    if time.monotonic() - ex.progress_at <= timeout:
        return None
    last = "no step yet" if current.last_step is None else f"last step {current.last_step}"
    return f"no step for {timeout:g} s (hung?); {last}"


def _execute(ctx: Context, ex: Execution, fx: Effects, lost: str | None) -> None:
    """Committed: now the workers may be told, and the next worker group started."""
    for attempt, plan in fx.answers:
        if plan is not None:
            ex.attempt = int(plan["attempt"])
            ex.progress_at = time.monotonic()  # the next attempt's clock starts with its plan
        ctx.launcher.answer_plan(ex.handle, attempt, plan)
    if fx.send_stop:
        ctx.launcher.request_stop(ex.handle)
        ex.stop_sent_at = time.monotonic()
    if fx.kill and lost is None:
        ctx.launcher.kill(ex.handle)
    remove_checkpoint_dirs(sorted(set(fx.doomed)), ctx.settings.checkpoint_root, ctx.settings.checkpoint_storage())
    if fx.launch is not None:
        launch(ctx, ex.run_id, fx.launch)


def _ingest(ctx: Context, s: Session, run: Run, ex: Execution, events: Sequence[Mapping[str, Any]]) -> bool:
    """Store the events per attempt; an attempt's first events mark it (and the run) running. True when new
    checkpoints arrived."""
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
                               metrics_every_steps=ctx.settings.metrics_every_steps)
        new_checkpoints = new_checkpoints or result.checkpoints > 0
        current = number == ex.attempt
        if current:
            ex.started = True
            ex.progress_at = time.monotonic()
        workers_started(s, run, attempt, current=current,
                        note=Note(f"attempt {number} running", {"attempt": number}))
    return new_checkpoints

