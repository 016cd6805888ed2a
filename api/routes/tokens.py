"""``/tokens`` (admin): issue, list and revoke API tokens. The CLI's ``ballast token create`` does the same
directly against the database, for the first admin token."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Path, Query, Request

from api.auth import AdminPrincipal, issue_token
from api.bodies import require_json
from api.deps import MAX_ID, SessionDep, SettingsDep
from api.errors import ApiError, problem_responses
from api.schemas import PRINCIPAL_PATTERN, Page, TokenCreate, TokenCreated, TokenRead
from orchestrator.store import repo

router = APIRouter(tags=["tokens"])


@router.post(
    "/tokens",
    status_code=201,
    summary="Issue an API token (shown once)",
    responses=problem_responses(401, 403, 409, 415, 422),
    dependencies=[Depends(require_json)],
)
def create_token(
    principal: AdminPrincipal, session: SessionDep, settings: SettingsDep, body: TokenCreate
) -> TokenCreated:
    row, token = issue_token(
        session=session, pepper=settings.token_pepper, name=body.name, principal=body.principal,
        scopes=list(body.scopes),
    )
    session.commit()
    return TokenCreated.model_validate({**TokenRead.model_validate(row).model_dump(), "token": token})


@router.get("/tokens", summary="List API tokens (never their values)", responses=problem_responses(401, 403, 422))
def list_tokens(
    principal: AdminPrincipal,
    session: SessionDep,
    owner: Annotated[str | None, Query(max_length=100, pattern=PRINCIPAL_PATTERN,
                                       description="Only tokens acting as this principal.")] = None,
) -> Page[TokenRead]:
    rows = repo.list_tokens(session=session, principal=owner)
    return Page[TokenRead](data=[TokenRead.model_validate(t) for t in rows], count=len(rows), next=None)


@router.delete(
    "/tokens/{token_id}",
    summary="Revoke an API token",
    responses=problem_responses(401, 403, 404, 422),
)
def revoke_token(
    principal: AdminPrincipal,
    session: SessionDep,
    request: Request,
    token_id: Annotated[int, Path(ge=1, le=MAX_ID)],
) -> TokenRead:
    row = repo.revoke_token(session=session, token_id=token_id)
    if row is None:
        raise ApiError(404, f"token {token_id} not found", slug="not-found")
    session.commit()
    request.app.state.token_cache.clear()  # revoked here: refused from the next request on
    return TokenRead.model_validate(row)
