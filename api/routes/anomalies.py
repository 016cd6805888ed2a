"""``/runs/{run_id}/anomalies``: what the detectors found, filterable by kind, attempt and step range."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated

from fastapi import APIRouter, Query

from api.auth import ReadableRun
from api.deps import MAX_ID, SessionDep
from api.errors import problem_responses
from api.schemas import AnomalyRead, Page
from api.serialize import anomaly_read
from contracts.wire import ANOMALY_KINDS
from orchestrator.store import repo

AnomalyKind = StrEnum("AnomalyKind", {k: k for k in ANOMALY_KINDS})  # type: ignore[misc]
"""The ``kind`` filter's values: an unknown kind is a 422 naming the allowed ones, not an empty page."""

router = APIRouter(tags=["anomalies"])

StepQuery = Annotated[int | None, Query(ge=0, le=MAX_ID)]


@router.get(
    "/runs/{run_id}/anomalies",
    summary="A run's anomalies, in the order they were detected",
    responses=problem_responses(401, 403, 404, 422),
)
def list_anomalies(
    run: ReadableRun,
    session: SessionDep,
    kind: Annotated[AnomalyKind | None, Query(examples=["grad_norm_spike"])] = None,
    attempt: Annotated[int | None, Query(ge=1, le=MAX_ID, description="Attempt number.")] = None,
    step_min: StepQuery = None,
    step_max: StepQuery = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    cursor: Annotated[str | None, Query(max_length=200, description="`next` of the previous page.")] = None,
) -> Page[AnomalyRead]:
    page = repo.list_anomalies(
        session=session, run_id=run.id, kind=None if kind is None else str(kind), attempt=attempt,
        step_min=step_min, step_max=step_max, limit=limit, cursor=cursor,
    )
    return Page[AnomalyRead](
        data=[anomaly_read(a, n) for a, n in page.rows], count=page.count, next=page.next_cursor
    )
