"""``/runs/{run_id}/attempts``: every try at a run, with the settings it ran with."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path

from api.auth import ReadableRun
from api.deps import MAX_ID, SessionDep
from api.errors import ApiError, problem_responses
from api.schemas import AttemptRead, Page
from orchestrator.store import repo

router = APIRouter(tags=["attempts"])


@router.get(
    "/runs/{run_id}/attempts",
    summary="A run's attempts, in order",
    description="All attempts (a run has a handful, bounded by its retry budgets), so `next` is always null.",
    responses=problem_responses(401, 403, 404, 422),
)
def list_attempts(run: ReadableRun, session: SessionDep) -> Page[AttemptRead]:
    rows = repo.list_attempts(session=session, run_id=run.id)
    return Page[AttemptRead](data=[AttemptRead.model_validate(a) for a in rows], count=len(rows), next=None)


@router.get(
    "/runs/{run_id}/attempts/{number}",
    summary="One attempt by its number",
    responses=problem_responses(401, 403, 404, 422),
)
def get_attempt(
    run: ReadableRun,
    session: SessionDep,
    number: Annotated[int, Path(ge=1, le=MAX_ID, description="Attempt number (1-based).")],
) -> AttemptRead:
    att = repo.get_attempt(session=session, run_id=run.id, number=number)
    if att is None:
        raise ApiError(404, f"run {run.id} has no attempt {number}", slug="not-found")
    return AttemptRead.model_validate(att)
