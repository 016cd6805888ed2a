"""``/runs``: submit a recipe as a run, list and inspect runs, cancel and retry them."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, Query, Response
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.auth import ReadableRun, ReadPrincipal, SubmitPrincipal, WritableRun
from api.deps import RecipeBody, SessionDep, recipe_request_body, require_json
from api.errors import ApiError, problem_responses
from api.schemas import AttemptRead, Page, RetryRequest, RetryResult, RunDetail, RunRead, RunSummary
from orchestrator.recipe import FieldError, RecipeError
from orchestrator.states import RunState
from orchestrator.store import repo
from orchestrator.store.models import Run

router = APIRouter(tags=["runs"])

NAME_PATTERN = r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$"
OWNER_PATTERN = r"^[A-Za-z0-9._@-]+$"


def run_read(run: Run, anomalies: dict[str, int]) -> RunRead:
    """ORM run (with its recipe row) → RunRead."""
    return RunRead.model_validate(_run_fields(run, anomalies))


def _run_fields(run: Run, anomalies: dict[str, int]) -> dict[str, Any]:
    max_steps = run.recipe.parsed.get("training", {}).get("max_steps")
    return {
        "id": run.id,
        "name": run.name,
        "owner": run.owner,
        "state": run.state,
        "recipe_id": run.recipe_id,
        "content_hash": run.recipe.content_hash,
        "idempotency_key": run.idempotency_key,
        "current_attempt": run.current_attempt,
        "cancel_requested": run.cancel_requested,
        "reason": run.reason,
        "created_at": run.created_at,
        "updated_at": run.updated_at,
        "started_at": run.started_at,
        "ended_at": run.ended_at,
        "summary": RunSummary(
            best_loss=run.best_loss,
            last_step=run.last_step,
            max_steps=max_steps if isinstance(max_steps, int) else None,
            retries_used=run.retries_used,
            crash_restarts_used=run.crash_restarts_used,
            anomalies_by_kind=anomalies,
            anomalies_total=sum(anomalies.values()),
        ),
    }


def run_detail(session: Session, run: Run) -> RunDetail:
    counts = repo.anomaly_counts(session=session, run_ids=[run.id])[run.id]
    current = repo.newest_attempt(session=session, run_id=run.id)
    fields = _run_fields(run, counts)
    fields["attempt"] = AttemptRead.model_validate(current) if current is not None else None
    fields["recipe"] = run.recipe.parsed
    return RunDetail.model_validate(fields)


@router.post(
    "/runs",
    status_code=201,
    summary="Submit a recipe as a new run",
    description=(
        "Validates the recipe (YAML or JSON) and queues a run owned by the caller. With an `Idempotency-Key` "
        "header, resending the same request returns the run the first one created (status 200 instead of "
        "201) and never creates a second; reusing a key for a different recipe is a 409."
    ),
    responses={
        200: {"model": RunRead, "description": "An earlier submission with this Idempotency-Key (replay)."},
        201: {"description": "The run was created (queued)."},
        **problem_responses(401, 403, 409, 413, 415, 422),
    },
    openapi_extra=recipe_request_body("A stability recipe (`apiVersion: ballast/v1`)."),
)
def submit_run(
    principal: SubmitPrincipal,
    session: SessionDep,
    body: RecipeBody,
    response: Response,
    idempotency_key: Annotated[
        str | None,
        Header(
            alias="Idempotency-Key",
            min_length=1,
            max_length=200,
            pattern=r"^[!-~]+$",
            description="Client-chosen key (printable ASCII, e.g. a UUID) that makes resubmission safe.",
        ),
    ] = None,
) -> RunRead:
    def replay(existing: Run) -> RunRead:
        if existing.recipe.content_hash != body.content_hash:
            raise ApiError(
                409,
                f"Idempotency-Key {idempotency_key!r} was already used for a different recipe (run {existing.id})",
                slug="idempotency-key-reused",
            )
        response.status_code = 200
        response.headers["Location"] = f"/api/v1/runs/{existing.id}"
        counts = repo.anomaly_counts(session=session, run_ids=[existing.id])[existing.id]
        return run_read(existing, counts)

    try:
        run, created = repo.create_run(
            session=session, owner=principal.name, recipe=body.recipe, text=body.text,
            idempotency_key=idempotency_key,
        )
        if not created:
            return replay(run)
        session.commit()
    except IntegrityError:
        # a concurrent request with the same key won the race on the (owner, idempotency_key) constraint
        session.rollback()
        if idempotency_key is None:
            raise
        existing = repo.get_run_by_idempotency_key(session=session, owner=principal.name, key=idempotency_key)
        if existing is None:
            raise
        return replay(existing)
    response.headers["Location"] = f"/api/v1/runs/{run.id}"
    return run_read(run, {})


@router.get(
    "/runs",
    summary="List runs, newest first",
    description="Non-admin principals see only their own runs (an `owner` filter naming someone else matches "
    "nothing). Page with `cursor` = the previous page's `next`.",
    responses=problem_responses(401, 403, 422),
)
def list_runs(
    principal: ReadPrincipal,
    session: SessionDep,
    state: Annotated[list[RunState] | None, Query(description="Only runs in these states (repeatable).")] = None,
    name: Annotated[str | None, Query(max_length=100, pattern=NAME_PATTERN, description="Exact run name.")] = None,
    owner: Annotated[str | None, Query(max_length=100, pattern=OWNER_PATTERN, description="Owner (admins).")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=200, description="`next` of the previous page.")] = None,
) -> Page[RunRead]:
    if not principal.is_admin:
        if owner is not None and owner != principal.name:
            return Page[RunRead](data=[], count=0, next=None)
        owner = principal.name
    page = repo.list_runs(session=session, owner=owner, states=state or (), name=name, limit=limit, cursor=cursor)
    counts = repo.anomaly_counts(session=session, run_ids=[r.id for r in page.rows])
    return Page[RunRead](data=[run_read(r, counts[r.id]) for r in page.rows], count=page.count, next=page.next_cursor)


@router.get(
    "/runs/{run_id}",
    summary="A run: state, current attempt, summary and recipe",
    responses=problem_responses(401, 403, 404, 422),
)
def get_run(run: ReadableRun, session: SessionDep) -> RunDetail:
    return run_detail(session, run)


@router.post(
    "/runs/{run_id}/cancel",
    summary="Cancel a run",
    description="A queued run is cancelled at once (200, `state: cancelled`). An active run is flagged "
    "(202, `cancel_requested: true`) and the scheduler stops it. A finished run cannot be cancelled (409).",
    responses={
        202: {"model": RunRead, "description": "Cancel requested; the scheduler will stop the run."},
        **problem_responses(401, 403, 404, 409, 422),
    },
)
def cancel_run(run: WritableRun, principal: SubmitPrincipal, session: SessionDep, response: Response) -> RunRead:
    repo.request_cancel(session=session, run=run, by=principal.name)
    session.commit()
    if run.state != RunState.cancelled.value:
        response.status_code = 202
    counts = repo.anomaly_counts(session=session, run_ids=[run.id])[run.id]
    return run_read(run, counts)


@router.post(
    "/runs/{run_id}/retry",
    status_code=202,
    summary="Retry a failed or cancelled run",
    description="Re-queues the run with a new `pending` attempt of kind `manual`, resuming from the newest "
    "healthy checkpoint. The attempt keeps the previous attempt's tightened settings; `overrides` "
    '(`{"optimizer.lr": 0.001}`) are applied on top and validated against the recipe schema. Other states: 409.',
    responses=problem_responses(401, 403, 404, 409, 415, 422),
    dependencies=[Depends(require_json)],
)
def retry_run(
    run: WritableRun,
    principal: SubmitPrincipal,
    session: SessionDep,
    body: Annotated[RetryRequest | None, Body()] = None,
) -> RetryResult:
    try:
        attempt = repo.request_retry(
            session=session, run=run, by=principal.name, overrides=body.overrides if body is not None else None
        )
    except RecipeError as exc:
        raise RecipeError([FieldError(f"overrides.{e.path}", e.message, None) for e in exc.errors]) from None
    session.commit()
    counts = repo.anomaly_counts(session=session, run_ids=[run.id])[run.id]
    return RetryResult(run=run_read(run, counts), attempt=AttemptRead.model_validate(attempt))
