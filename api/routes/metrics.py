"""``/runs/{run_id}/metrics``: per-step series (loss, grad norm, LR, ..., the held-out eval loss) downsampled so spikes
stay visible."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.auth import ReadableRun
from api.deps import MAX_ID, SessionDep
from api.errors import invalid_request, problem_responses
from api.schemas import MetricName, MetricSeries, MetricsRead
from contracts.recipe import FieldError
from orchestrator.store import repo

router = APIRouter(tags=["metrics"])


@router.get(
    "/runs/{run_id}/metrics",
    summary="Metric series of a run",
    description="Each series in (attempt, step) order, as parallel arrays. When more than `max_points` points "
    "are in range, they are split into `max_points / 2` buckets and each keeps its minimum and maximum (a NaN "
    "or infinity counts as the extreme), so a one-step spike survives downsampling. `eval_loss` (recipes with "
    "`training.eval_interval`) is the held-out loss: sparse, and its steps count completed steps (the weights after "
    "that many updates, like a checkpoint's step). `skipped` is sparse too: the steps whose update was discarded (a "
    "guard's `skip_step`, an fp16 overflow), each with the value 1; their loss is the batch's, not the model's.",
    responses=problem_responses(401, 403, 404, 422),
)
def get_metrics(
    run: ReadableRun,
    session: SessionDep,
    series: Annotated[
        list[MetricName] | None, Query(description="Series to return (repeatable); default: all.")
    ] = None,
    step_min: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
    step_max: Annotated[int | None, Query(ge=0, le=MAX_ID)] = None,
    attempt: Annotated[int | None, Query(ge=1, le=MAX_ID, description="Only this attempt (number).")] = None,
    max_points: Annotated[int, Query(ge=2, le=10_000)] = 1000,
) -> MetricsRead:
    if step_min is not None and step_max is not None and step_min > step_max:
        raise invalid_request([FieldError("query.step_min", f"must not exceed step_max ({step_max})")],
                              "step_min is after step_max")
    names = list(dict.fromkeys(series)) if series else list(repo.METRIC_SERIES)
    out = repo.metric_series(
        session=session, run_id=run.id, series=names, step_min=step_min, step_max=step_max, attempt=attempt,
        max_points=max_points,
    )
    return MetricsRead(
        run_id=run.id,
        max_points=max_points,
        series=[
            MetricSeries.model_validate(
                {"name": s.name, "steps": s.steps, "values": s.values, "attempts": s.attempts,
                 "total_points": s.total, "downsampled": s.downsampled}
            )
            for s in out
        ],
    )
