"""``/runs``: submit a recipe as a run, list and inspect runs, cancel and retry them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated

from fastapi import APIRouter, Body, Depends, Header, Query, Request, Response
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.auth import Principal, ReadPrincipal, SubmitPrincipal, WritableRun, run_not_found
from api.bodies import RecipeBody, SubmittedRecipe, recipe_request_body, require_json
from api.deps import RunId, SessionDep, in_db_thread
from api.errors import ApiError, problem_responses
from api.schemas import (
    PRINCIPAL_PATTERN,
    RUN_NAME_PATTERN,
    AttemptRead,
    Page,
    RetryRequest,
    RetryResult,
    RunDetail,
    RunRead,
)
from api.serialize import run_fields, run_read
from contracts.recipe import FieldError, RecipeError
from orchestrator.policy.states import RunState
from orchestrator.store import repo
from orchestrator.store.db import AsyncReadPool
from orchestrator.store.models import Run

router = APIRouter(tags=["runs"])


def _run_detail(found: repo.RunOverview | None, run_id: int) -> RunDetail:
    """The overview (``repo.get_run_overview``) → RunDetail; 404 for a run that is absent or someone else's."""
    if found is None:
        raise run_not_found(run_id)
    overrides = found.attempt["overrides"] if found.attempt is not None else None
    fields = run_fields(found.run, found.content_hash, found.recipe, found.anomalies_by_kind, overrides)
    fields["attempt"] = AttemptRead.model_validate(found.attempt) if found.attempt is not None else None
    fields["recipe"] = found.recipe
    return RunDetail.model_validate(fields)


def _read_overview(session: Session, run_id: int, owner: str | None) -> repo.RunOverview | None:
    return repo.get_run_overview(session=session, run_id=run_id, owner=owner)


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
async def submit_run(
    principal: SubmitPrincipal,
    request: Request,
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
    return await in_db_thread(request, _submit, principal, body, response, idempotency_key)


def _submit(
    session: Session, principal: Principal, body: SubmittedRecipe, response: Response, idempotency_key: str | None
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
async def list_runs(
    principal: ReadPrincipal,
    request: Request,
    state: Annotated[list[RunState] | None, Query(description="Only runs in these states (repeatable).")] = None,
    name: Annotated[str | None, Query(max_length=100, pattern=RUN_NAME_PATTERN, description="Exact run name.")] = None,
    owner: Annotated[
        str | None, Query(max_length=100, pattern=PRINCIPAL_PATTERN, description="Owner (admins).")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=200, description="`next` of the previous page.")] = None,
) -> Page[RunRead]:
    if not principal.is_admin:
        if owner is not None and owner != principal.name:
            return Page[RunRead](data=[], count=0, next=None)
        owner = principal.name
    return await in_db_thread(request, _list_page, owner, state or (), name, limit, cursor)


def _list_page(
    session: Session, owner: str | None, states: Sequence[RunState], name: str | None, limit: int, cursor: str | None
) -> Page[RunRead]:
    page = repo.list_runs(session=session, owner=owner, states=states, name=name, limit=limit, cursor=cursor)
    ids = [r.id for r in page.rows]
    counts = repo.anomaly_counts(session=session, run_ids=ids)
    overrides = repo.current_overrides(session=session, run_ids=ids)
    return Page[RunRead](data=[run_read(r, counts[r.id], overrides[r.id]) for r in page.rows], count=page.count,
                         next=page.next_cursor)


@router.get(
    "/runs/{run_id}",
    summary="A run: state, current attempt, summary and recipe",
    responses=problem_responses(401, 403, 404, 422),
)
async def get_run(run_id: RunId, principal: ReadPrincipal, request: Request) -> RunDetail:
    pool: AsyncReadPool | None = request.app.state.read_pool
    owner = principal.owner_filter
    if pool is not None:  # PostgreSQL: on the event loop
        found = await repo.read_run_overview(pool=pool, run_id=run_id, owner=owner)
    else:  # SQLite's driver blocks (as does any database of an app run without its lifespan): one thread hop
        found = await in_db_thread(request, _read_overview, run_id, owner)
    return _run_detail(found, run_id)


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
    return run_read(run, counts, repo.current_overrides(session=session, run_ids=[run.id])[run.id])


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
    return RetryResult(run=run_read(run, counts, attempt.overrides), attempt=AttemptRead.model_validate(attempt))
