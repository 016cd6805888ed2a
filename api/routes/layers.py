"""``/runs/{run_id}/layers``: the per-layer gradient-norm profile by depth over time, every snapshot the store keeps.

Workers measure it every ``telemetry.layer_stats_every`` steps and ingestion keeps each one (``layer_snapshots``),
so the dashboard can draw a step × depth heat map per attempt and follow it live with ``attempt`` + ``after_step``.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.auth import ReadableRun
from api.deps import MAX_ID, SessionDep
from api.errors import problem_responses
from api.schemas import LayerSnapshot, Page
from api.serialize import layer_snapshot
from orchestrator.store import repo

router = APIRouter(tags=["metrics"])


@router.get(
    "/runs/{run_id}/layers",
    summary="Per-layer gradient norms by depth, every snapshot in (attempt, step) order",
    description="One entry per `layer_stats` measurement (`telemetry.layer_stats_every`), ordered by attempt "
    "number, then step. `attempt` keeps one attempt; `after_step` keeps the steps after it (a live page asks for "
    "what it has not seen). Pages of `limit`; pass `next` back as `cursor`.",
    responses=problem_responses(401, 403, 404, 422),
)
def list_layer_snapshots(
    run: ReadableRun,
    session: SessionDep,
    attempt: Annotated[int | None, Query(ge=1, le=MAX_ID, description="Only this attempt (number).")] = None,
    after_step: Annotated[int | None, Query(ge=-1, le=MAX_ID, description="Only steps after this one.")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 500,
    cursor: Annotated[str | None, Query(max_length=200, description="`next` of the previous page.")] = None,
) -> Page[LayerSnapshot]:
    page = repo.list_layer_snapshots(session=session, run_id=run.id, attempt=attempt, after_step=after_step,
                                     limit=limit, cursor=cursor)
    return Page[LayerSnapshot](data=[layer_snapshot(r, n) for r, n in page.rows], count=page.count,
                               next=page.next_cursor)
