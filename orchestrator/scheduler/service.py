"""Servicing the worker groups, each tick: drain → effects → commit → execute.

1. **drain** the channels (events, open in-place plan requests, the fit's state), with every group's cursors read
   in one query; a lost channel reads as a failed fit;
2. work out the **effects** in one transaction: ingest the events, retire surplus checkpoints, answer plan
   requests (``handshake``), pass on a cancel, map an ended fit onto the attempt and the policy's next step;
3. **commit**, and only then
4. **execute** what the workers must be told (plan answers, stop, kill), remove retired checkpoint directories
   and launch the next worker group, so a scheduler that dies in between leaves a state the next one can finish.

The groups of a tick share a transaction (``service_all``; one per ``TRANSACTION_EVENTS`` events): the runs and
their attempts loaded in one query, every group's events written with one statement per table (``ingest_many``),
one commit. With 100 groups that is a handful of round trips per tick instead of ~11 per group; the channels are
polled a few at a time (``POLL_THREADS``). A run whose effects fail (a bug, a bad event) must not
hold the others back: the shared transaction is then rolled back and each group serviced again in a transaction of
its own, from the same drained data (nothing was acked, so nothing is lost or doubled), and the one that fails is
logged alone.

A running attempt whose events stop for ``resources.step_timeout_s`` (the step-progress deadline) is ended as
crashed ("no step for N s (hung?)") and its worker group torn down; the crash path resumes it. Whenever a group is
over, its checkpoint storage is reconciled with the store first (``storage``), so the policy resumes from the
newest checkpoint on storage.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, selectinload

from contracts.recipe import RecipeError
from orchestrator.policy.recovery import effective_recipe
from orchestrator.policy.rules import Note
from orchestrator.policy.states import TERMINAL_ATTEMPT_STATES, TERMINAL_RUN_STATES, AttemptState
from orchestrator.scheduler.context import Context, Execution, attempt_of
from orchestrator.scheduler.failures import Failure
from orchestrator.scheduler.handshake import answer_plan_request
from orchestrator.scheduler.launcher import ChannelLost
from orchestrator.scheduler.launching import launch
from orchestrator.scheduler.outage import cause, is_outage
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
from orchestrator.store.ingest import IngestResult, ingest_many
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


@dataclass
class _Drained:
    ex: Execution
    polled: dict[str, Any]
    lost: str | None
    """Why the channel is gone (None: it answered)."""


def service(ctx: Context, ex: Execution) -> None:
    """Drain one worker group into the store and act on what happened."""
    service_all(ctx, [ex])


TRANSACTION_EVENTS = 5000
"""Events per shared transaction, about: the groups of a tick are committed in chunks of this many events (a
group's events are never split), so a tick that drained a backlog makes its events visible chunk by chunk, not all
at its very end; a few thousand events are plenty to spread a transaction's round trips over."""


def service_all(ctx: Context, executions: Sequence[Execution]) -> None:
    """Drain these worker groups into the store, in shared transactions, and act on what happened (see above).

    A database outage propagates (the whole tick failed); any other error is one group's, logged, and the others
    go on."""
    chunk: list[_Drained] = []
    size = 0
    for d in _drain_all(ctx, executions):
        chunk.append(d)
        size += len(d.polled.get("events") or ())
        if size >= TRANSACTION_EVENTS:
            _service_chunk(ctx, chunk)
            chunk, size = [], 0
    if chunk:
        _service_chunk(ctx, chunk)


def _service_chunk(ctx: Context, drained: Sequence[_Drained]) -> None:
    together = _effects_together(ctx, drained) if len(drained) > 1 else None
    if together is None:  # one group, or the shared transaction failed: each group commits and executes alone
        for d in drained:
            try:
                _service_one(ctx, d)
            except Exception as exc:  # noqa: BLE001 - one run's failure must not stall the others
                _failed(d.ex, exc)
        return
    # committed for all: every group is told what was decided even if the database goes away meanwhile (as the
    # one-by-one path tells each group right after its own commit); the outage is raised once all were told
    outage: Exception | None = None
    for d, fx in together:
        if fx is None:
            continue
        try:
            _execute(ctx, d.ex, fx, d.lost)
        except Exception as exc:  # noqa: BLE001 - one run's failure must not stall the others
            if is_outage(exc):
                outage = outage or exc
            else:
                _failed(d.ex, exc)
    if outage is not None:
        raise outage


POLL_THREADS = 16
"""Channels polled at once. A poll is a round trip to the channel's actor process, mostly waiting for that process
to be scheduled; one after another, 100 of them took most of a tick on a loaded machine."""
_pollers: ThreadPoolExecutor | None = None


def _drain_all(ctx: Context, executions: Sequence[Execution]) -> list[_Drained]:
    """Every group's cursors in one query, then their channels' polls, overlapped; in the order given."""
    global _pollers
    if not executions:
        return []
    acked = _cursors(ctx, [ex.run_id for ex in executions])

    def drain(ex: Execution) -> _Drained | Exception | None:
        try:
            return _drain(ctx, ex, acked.get(ex.run_id, {}))
        except Exception as exc:  # noqa: BLE001 - handed back: one run's failure must not stall the others
            return exc

    if len(executions) == 1:
        outcomes = [drain(executions[0])]
    else:
        if _pollers is None:
            _pollers = ThreadPoolExecutor(POLL_THREADS, thread_name_prefix="ballast-poll")
        outcomes = list(_pollers.map(drain, executions))
    drained: list[_Drained] = []
    for ex, out in zip(executions, outcomes, strict=True):
        if isinstance(out, Exception):
            _failed(ex, out)
        elif out is not None:
            drained.append(out)
    return drained


def _service_one(ctx: Context, d: _Drained) -> None:
    with transaction(ctx.sf) as s:
        fx = _effects(ctx, s, d.ex, d.polled, s.get(Run, d.ex.run_id, populate_existing=True))
    if fx is not None:
        _execute(ctx, d.ex, fx, d.lost)


def _failed(ex: Execution, exc: Exception) -> None:
    if is_outage(exc):
        raise exc
    log.error("servicing run %s failed", ex.run_id, exc_info=exc)


def _cursors(ctx: Context, run_ids: Sequence[int]) -> dict[int, dict[int, int]]:
    """Per run, each attempt's newest committed ``seq``: what its channel may drop."""
    acked: dict[int, dict[int, int]] = {}
    with transaction(ctx.sf) as s:
        rows = s.execute(sa.select(Attempt.run_id, Attempt.number, Attempt.last_seq)
                         .where(Attempt.run_id.in_(run_ids))).all()
    for run_id, number, seq in rows:
        acked.setdefault(int(run_id), {})[int(number)] = int(seq or 0)
    return acked


def _drain(ctx: Context, ex: Execution, acked: Mapping[int, int]) -> _Drained | None:
    """The channel's poll (None: busy, try next tick); a lost channel reads as a failed fit."""
    try:
        polled = ctx.launcher.poll(ex.handle, acked)
    except ChannelLost as exc:
        lost = str(exc)
        return _Drained(ex, {"events": [], "plan_requests": [], "fit": {"state": "failed", "error": lost}}, lost)
    return None if polled is None else _Drained(ex, polled, None)


def _effects_together(ctx: Context, drained: Sequence[_Drained]) -> list[tuple[_Drained, Effects | None]] | None:
    """Every group's effects in one transaction, the events of all of them written together; None when that
    failed for a reason other than an outage (rolled back: the caller services the groups one by one)."""
    try:
        with transaction(ctx.sf) as s:
            ids = [d.ex.run_id for d in drained]
            runs = {r.id: r for r in s.scalars(
                sa.select(Run).where(Run.id.in_(ids)).options(selectinload(Run.attempts))
                .execution_options(populate_existing=True)
            ).unique()}
            batches = [b for d in drained if _admitted(ctx, runs.get(d.ex.run_id))
                       for b in _batches(runs[d.ex.run_id], d.ex, d.polled)]
            ingested = {attempt.id: res for (_, attempt, _), res in zip(
                batches, ingest_many(session=s, batches=batches, metrics_every_steps=ctx.settings.metrics_every_steps),
                strict=True)}
            return [(d, _effects(ctx, s, d.ex, d.polled, runs.get(d.ex.run_id), ingested)) for d in drained]
    except Exception as exc:  # noqa: BLE001 - retried group by group, where a bad one fails alone
        if is_outage(exc):
            raise
        log.warning("servicing %d runs together failed (%s); servicing them one by one", len(drained),
                    cause(exc))
        return None


def _admitted(ctx: Context, run: Run | None) -> bool:
    """The run's events are stored: it is still this scheduler's and not over."""
    return run is not None and run.claimed_by == ctx.id and run.state not in TERMINAL_RUN_STATES


def _batches(run: Run, ex: Execution,
             polled: Mapping[str, Any]) -> list[tuple[Run, Attempt, list[Mapping[str, Any]]]]:
    """The drained events per known attempt, in attempt order (unknown attempts' are left to ``_ingest``)."""
    by_attempt: dict[int, list[Mapping[str, Any]]] = {}
    for ev in polled.get("events") or []:
        by_attempt.setdefault(int(ev.get("attempt", ex.attempt)), []).append(ev)
    out = []
    for number, evs in sorted(by_attempt.items()):
        attempt = next((a for a in run.attempts if a.number == number), None)
        if attempt is not None:
            out.append((run, attempt, evs))
    return out


def _effects(ctx: Context, s: Session, ex: Execution, polled: Mapping[str, Any], run: Run | None,
             ingested: Mapping[int, IngestResult] | None = None) -> Effects | None:
    """What the group's poll means, written in ``s``; ``ingested``: its events' results per attempt id when
    they were written already (``_effects_together``), else they are written here."""
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
    if _ingest(ctx, s, run, ex, polled, ingested):
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


def _ingest(ctx: Context, s: Session, run: Run, ex: Execution, polled: Mapping[str, Any],
            ingested: Mapping[int, IngestResult] | None) -> bool:
    """Store the events per attempt (unless ``ingested`` holds them already); an attempt's first events mark it
    (and the run) running. True when new checkpoints arrived."""
    batches = _batches(run, ex, polled)
    known = {attempt.number for _, attempt, _ in batches}
    for ev in polled.get("events") or []:
        number = int(ev.get("attempt", ex.attempt))
        if number not in known:
            known.add(number)
            n = sum(1 for e in polled.get("events") or [] if int(e.get("attempt", ex.attempt)) == number)
            log.warning("run %s: %d events for unknown attempt %s dropped", run.id, n, number)
    if ingested is None:
        results = ingest_many(session=s, batches=batches, metrics_every_steps=ctx.settings.metrics_every_steps)
        ingested = {attempt.id: res for (_, attempt, _), res in zip(batches, results, strict=True)}
    new_checkpoints = False
    for _, attempt, _ in batches:
        new_checkpoints = new_checkpoints or ingested[attempt.id].checkpoints > 0
        current = attempt.number == ex.attempt
        if current:
            ex.started = True
            ex.progress_at = time.monotonic()
        workers_started(s, run, attempt, current=current,
                        note=Note(f"attempt {attempt.number} running", {"attempt": attempt.number}))
    return new_checkpoints
