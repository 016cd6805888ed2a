"""The in-place recovery handshake: rank 0 of a diverged attempt asks for the next attempt inside the same worker
group (``RunChannel.request_plan``); the scheduler records the policy's decision and answers with the next
attempt's spec, or None, which ends the worker group (the normal path then restarts it, or the run has failed
when the policy gave up here). The answer is sent only after the decision is committed."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from sqlalchemy.orm import Session

from contracts.recipe import RecipeError
from orchestrator.policy.recovery import effective_recipe
from orchestrator.policy.rules import Note
from orchestrator.policy.states import TERMINAL_ATTEMPT_STATES, AttemptState
from orchestrator.scheduler.context import Context, attempt_of
from orchestrator.scheduler.launching import spec_dict
from orchestrator.scheduler.outcomes import conclude, workers_started
from orchestrator.store.ingest import ingest_events
from orchestrator.store.models import Attempt, Run
from orchestrator.store.records import StoredOutcome

log = logging.getLogger("ballast.scheduler")


def answer_plan_request(
    ctx: Context, s: Session, run: Run, current: int, channel: str, req: Mapping[str, Any]
) -> dict[str, Any] | None:
    """The plan for the workers (``{"attempt", "spec", "reason"}``), or None: end the worker group."""
    attempt = _diverged_attempt(ctx, s, run, current, req)
    if attempt is None:
        return None
    workers_started(s, run, attempt, current=True, note=Note(f"attempt {attempt.number} running"))
    prepared: dict[str, Any] = {}

    def continue_in_place(new: Attempt) -> str | None:
        try:
            prepared["spec"] = spec_dict(ctx, s, run, new)
        except Exception as exc:  # noqa: BLE001 - fall back to a full restart, which reports the problem
            log.warning("run %s: in-place spec failed (%s); restarting the worker group", run.id, exc)
            return None
        new.plan = {**(new.plan or {}), "in_place": True}
        new.ray_info = {**(attempt.ray_info or {}), "in_place": True}
        return f"continues in place in worker group {channel}"

    nxt = conclude(ctx, s, run, attempt, AttemptState.diverged, in_place=continue_in_place)
    if nxt.attempt is None or "spec" not in prepared:
        return None
    return {"attempt": nxt.attempt.number, "spec": prepared["spec"], "reason": nxt.attempt.reason}


def _diverged_attempt(ctx: Context, s: Session, run: Run, current: int, req: Mapping[str, Any]) -> Attempt | None:
    """The requesting attempt, if it may continue in place: the group's current one, not ended, diverged (its
    ``end`` recorded from the request if the event has not arrived), with ``recovery.in_place`` on."""
    number = int(req["attempt"])
    if number != current or run.cancel_requested:
        return None
    attempt = attempt_of(run, number)
    if attempt.state in TERMINAL_ATTEMPT_STATES:
        return None
    if not StoredOutcome.read(attempt.outcome).verdict:
        ingest_events(session=s, run=run, attempt=attempt,
                      events=[{"seq": attempt.last_seq, "type": "end", "data": dict(req.get("end") or {})}])
    if StoredOutcome.read(attempt.outcome).verdict != AttemptState.diverged.value:
        return None
    try:
        eff = effective_recipe(ctx.recipe(run), attempt.overrides or {})
    except RecipeError:
        return None
    return attempt if eff.recovery.in_place else None
