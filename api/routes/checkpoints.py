"""``/runs/{run_id}/checkpoints``: saved checkpoints with their health verdicts."""

from __future__ import annotations

from fastapi import APIRouter

from api.auth import ReadableRun
from api.deps import SessionDep
from api.errors import problem_responses
from api.schemas import CheckpointRead, Page
from api.serialize import checkpoint_read
from orchestrator.store import repo

router = APIRouter(tags=["checkpoints"])

@router.get(
    "/runs/{run_id}/checkpoints",
    summary="A run's checkpoints by step",
    description="Including those removed by retention (`deleted: true`), so the history stays readable. "
    "All of them in one page (`next` is null).",
    responses=problem_responses(401, 403, 404, 422),
)
def list_checkpoints(run: ReadableRun, session: SessionDep) -> Page[CheckpointRead]:
    rows = repo.list_checkpoints(session=session, run_id=run.id)
    return Page[CheckpointRead](data=[checkpoint_read(c, n) for c, n in rows], count=len(rows), next=None)
