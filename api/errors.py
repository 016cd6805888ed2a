"""Every error the API returns is an RFC 9457 problem document (``application/problem+json``).

Clients (the CLI, scripts) get one shape for everything that went wrong: ``type``, ``title``, ``status``,
``detail`` and, for invalid input, ``errors`` with one entry per field (its dotted path, the message and, for
YAML recipes, the line). Client input must never produce a 500: the handlers here turn each known failure into
its 4xx; only a genuine server bug is a 500.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping, Sequence
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.schemas import FieldErrorOut, Problem
from contracts.recipe import FieldError, RecipeError
from orchestrator.policy.states import IllegalTransition
from orchestrator.store.repo import BadCursor

PROBLEM_JSON = "application/problem+json"
log = logging.getLogger("ballast.api")


def problem_type(slug: str) -> str:
    """A stable identifier per kind of problem (a URN: nothing to dereference, nothing to go stale)."""
    return f"urn:ballast:problem:{slug}"


class ApiError(Exception):
    """Raised by routes and dependencies; rendered as a problem document with ``status``."""

    def __init__(
        self,
        status: int,
        detail: str | None = None,
        *,
        slug: str | None = None,
        title: str | None = None,
        errors: Sequence[FieldError] | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(detail or HTTPStatus(status).phrase)
        self.status = status
        self.detail = detail
        self.slug = slug
        self.title = title or HTTPStatus(status).phrase
        self.errors = list(errors) if errors is not None else None
        self.headers = dict(headers or {})


def invalid_request(errors: Sequence[FieldError], detail: str = "the request is invalid") -> ApiError:
    """The 422 for input that fails validation outside a recipe (parameters, bodies), naming each field."""
    return ApiError(422, detail, slug="invalid-request", title="Invalid request", errors=errors)


def problem_response(request: Request | None, error: ApiError) -> JSONResponse:
    """``error`` as its problem document (``instance`` is the request's path when there is a request)."""
    body = Problem(
        type=problem_type(error.slug) if error.slug else "about:blank",
        title=error.title,
        status=error.status,
        detail=error.detail,
        instance=request.url.path if request is not None else None,
        errors=[FieldErrorOut(path=e.path, message=e.message, line=e.line) for e in error.errors]
        if error.errors is not None
        else None,
    )
    return JSONResponse(
        body.model_dump(mode="json", exclude_none=True), status_code=error.status, media_type=PROBLEM_JSON,
        headers=error.headers,
    )


def _validation_path(loc: Sequence[Any]) -> str:
    """``("body", "overrides")`` → ``overrides``; ``("query", "limit")`` → ``query.limit``."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    return ".".join(str(p) for p in parts) or "<body>"


async def _api_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, ApiError)
    return problem_response(request, exc)


def _allowed_methods(request: Request) -> str | None:
    """Every method the path accepts. Starlette's ``Allow`` names only the first route matching the path, and
    ``GET /runs`` and ``POST /runs`` are two routes; the OpenAPI paths know them all."""
    paths: dict[str, Any] = request.app.openapi().get("paths", {})
    methods: set[str] = set()
    for template, ops in paths.items():
        pattern = "^" + re.sub(r"\\\{[^}]+\\\}", "[^/]+", re.escape(template)) + "$"
        if re.match(pattern, request.url.path):
            methods.update(m.upper() for m in ops if m in _HTTP_METHODS)
    return ", ".join(sorted(methods)) if methods else None


_HTTP_METHODS = {"get", "put", "post", "delete", "options", "head", "patch", "trace"}


async def _http_exception(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    phrase = HTTPStatus(exc.status_code).phrase
    detail = exc.detail if isinstance(exc.detail, str) and exc.detail != phrase else None
    headers = dict(exc.headers or {})
    if exc.status_code == 400 and isinstance(exc.__cause__, ValueError):
        # FastAPI's "error parsing the body" (e.g. a JSON body that is not UTF-8): invalid input, like a JSON
        # syntax error, so the same 422 with the body named
        return problem_response(
            request, invalid_request([FieldError("<body>", f"cannot be parsed ({type(exc.__cause__).__name__})")])
        )
    if exc.status_code == 405:
        headers["Allow"] = _allowed_methods(request) or headers.get("Allow", "")
    return problem_response(request, ApiError(exc.status_code, detail, headers=headers))


async def _request_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = []
    for err in exc.errors():
        msg = str(err.get("msg", "invalid"))
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        if err.get("type") == "json_invalid":  # its loc is a character offset, not a field
            detail = (err.get("ctx") or {}).get("error")
            errors.append(FieldError("<body>", f"invalid JSON: {detail}" if detail else "invalid JSON"))
            continue
        errors.append(FieldError(_validation_path(err.get("loc", ())), msg))
    return problem_response(request, invalid_request(errors))


async def _recipe_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RecipeError)
    invalid = ApiError(422, "the recipe is invalid", slug="invalid-recipe", title="Invalid recipe", errors=exc.errors)
    return problem_response(request, invalid)


async def _bad_cursor(request: Request, exc: Exception) -> JSONResponse:
    return problem_response(request, invalid_request([FieldError("query.cursor", str(exc))], str(exc)))


async def _illegal_transition(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, IllegalTransition)
    return problem_response(request, ApiError(
        409, f"the {exc.entity} is {exc.current}; it cannot become {exc.target}", slug="illegal-transition",
        title="Illegal state change",
    ))


async def _integrity_error(request: Request, exc: Exception) -> JSONResponse:
    # a unique or foreign-key constraint refused the write: a conflict with existing state, not a server bug
    log.info("integrity error on %s: %s", request.url.path, exc)
    return problem_response(request, ApiError(409, "the request conflicts with existing data", slug="conflict"))


async def _operational_error(request: Request, exc: Exception) -> JSONResponse:
    log.warning("database unavailable on %s: %s", request.url.path, exc)
    return problem_response(request, ApiError(
        503, "the database is unavailable; try again", slug="database-unavailable", headers={"Retry-After": "1"}
    ))


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path, exc_info=exc)
    return problem_response(request, ApiError(500, "an internal error occurred", slug="internal"))


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_exception)
    app.add_exception_handler(RequestValidationError, _request_validation)
    app.add_exception_handler(RecipeError, _recipe_error)
    app.add_exception_handler(BadCursor, _bad_cursor)
    app.add_exception_handler(IllegalTransition, _illegal_transition)
    app.add_exception_handler(IntegrityError, _integrity_error)
    app.add_exception_handler(OperationalError, _operational_error)
    app.add_exception_handler(Exception, _unhandled)


def problem_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` entries documenting the problem document for each status."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in statuses:
        out[status] = {
            "description": _DESCRIPTIONS.get(status, HTTPStatus(status).phrase),
            "content": {PROBLEM_JSON: {"schema": {"$ref": "#/components/schemas/Problem"}}},
        }
    return out


_DESCRIPTIONS = {
    401: "No bearer token, or an unknown or revoked one.",
    403: "The token lacks the scope this operation needs.",
    404: "No such resource (or it belongs to another principal).",
    409: "The change conflicts with the resource's current state.",
    413: "The body is larger than the configured limit (checked before parsing).",
    415: "The body's content type is not accepted here.",
    422: "The input is invalid; `errors` names each field.",
    503: "The database (or Ray) is not reachable.",
}
