"""Request bodies: the one size limit, content types, and reading a YAML or JSON recipe.

The size limit is ``BodyLimitMiddleware`` (every body the API accepts is at most a recipe, so the recipe limit
bounds them all). It is ours rather than FastAPI's ``max_body_size``: Starlette answers a declared
Content-Length over that limit with its own ``text/plain`` 413 at response start, replacing whatever the app
sent, so the problem document (``application/problem+json``) every other error gets could not be kept.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Annotated, Any

import yaml
from fastapi import Depends, Request
from pydantic_core import PydanticSerializationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from api.deps import SettingsDep
from api.errors import ApiError, problem_response
from contracts.recipe import (
    FieldError,
    Recipe,
    RecipeError,
    load_recipe,
    recipe_to_dict,
    validate_recipe_data,
)
from contracts.recipe.loading import INT_LIMIT
from orchestrator.runtime_env import code_refusals
from orchestrator.settings import Settings
from orchestrator.store.repo import content_hash


# ------------------------------------------------------------------------------------------------ the limit
class BodyTooLarge(StarletteHTTPException):
    """Raised from ``receive`` when a body grows past the limit (FastAPI re-raises HTTP exceptions as-is)."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is over the limit of {limit} bytes")


class BodyLimitMiddleware:
    """413 for bodies over ``max_bytes``: at once from a declared Content-Length (before routing, parsing or
    authentication), else as the bytes arrive."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                resp = problem_response(None, ApiError(
                    413, f"the request body is {int(value)} bytes, over the limit of {self.max_bytes}",
                    slug="too-large",
                ))
                await resp(scope, receive, send)
                return
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited, send)


# --------------------------------------------------------------------------------------------- content types
RECIPE_MEDIA_TYPES = {
    "application/json": "json",
    "application/yaml": "yaml",
    "application/x-yaml": "yaml",
    "text/yaml": "yaml",
}


def media_type(request: Request) -> str:
    """The Content-Type without its parameters (a ``charset`` is ignored: bodies are read as UTF-8)."""
    return request.headers.get("content-type", "").split(";")[0].strip().lower()


async def require_json(request: Request) -> None:
    """415 for a non-empty body that is not JSON (instead of a confusing 422 about the body's type)."""
    declared = request.headers.get("content-length")
    has_body = (declared is not None and declared != "0") or "transfer-encoding" in request.headers
    if not has_body:
        return
    media = media_type(request)
    if media != "application/json" and not media.endswith("+json"):
        raise ApiError(415, f"send JSON (application/json), not {media or 'no content type'!r}",
                       slug="unsupported-media-type")


# ------------------------------------------------------------------------------------------------ recipes
@dataclass(frozen=True)
class SubmittedRecipe:
    """A recipe body that parsed and validated: the model, its normalised dict and hash, and the text as sent."""

    recipe: Recipe
    normalised: dict[str, Any]
    content_hash: str
    text: str


def _reject_unstorable(value: Any, path: str, out: list[FieldError]) -> None:
    """Values a JSON column cannot hold faithfully on every backend: non-finite floats, NUL, lone surrogates."""
    if isinstance(value, float) and not math.isfinite(value):
        out.append(FieldError(path or "<recipe>", "must be a finite number"))
    elif isinstance(value, str):
        if "\x00" in value:
            out.append(FieldError(path or "<recipe>", "must not contain NUL characters"))
        else:
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                out.append(FieldError(path or "<recipe>", "is not valid Unicode (lone surrogate)"))
    elif isinstance(value, dict):
        for k, v in value.items():
            key = str(k)
            _reject_unstorable(key, f"{path}.{key}" if path else key, out)
            _reject_unstorable(v, f"{path}.{key}" if path else key, out)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _reject_unstorable(v, f"{path}.{i}" if path else str(i), out)


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise RecipeError([FieldError("<document>", f"duplicate key {k!r}")])
        out[k] = v
    return out


def _no_constants(name: str) -> Any:
    raise RecipeError([FieldError("<document>", f"invalid JSON: {name} is not a number")])


MAX_INT_DIGITS = 24
"""Digits of a JSON integer worth converting: every 64-bit integer has fewer; a longer one is refused before
Python's int() (past 4,300 digits a ValueError, and quadratic time before that)."""


class _HugeInt(str):
    """A JSON integer too long to convert, kept as its digits so the error can name the field it sits in."""


def _bounded_int(digits: str) -> int | _HugeInt:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        return _HugeInt(digits)
    return int(digits)


def _huge_ints(value: Any, path: str = "") -> list[FieldError]:
    """Every oversized integer of a parsed document, named by its field path."""
    if isinstance(value, _HugeInt):
        return [FieldError(path or "<document>", f"integer out of range: must fit in 64 bits (|x| <= {INT_LIMIT}); "
                                                 f"got {len(value.lstrip('-'))} digits")]
    if isinstance(value, dict):
        return [e for k, v in value.items() for e in _huge_ints(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, list):
        return [e for i, v in enumerate(value) for e in _huge_ints(v, f"{path}.{i}" if path else str(i))]
    return []


def _load_json_recipe(body: bytes, allowed: list[str]) -> tuple[Recipe, str]:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RecipeError([FieldError("<document>", f"not UTF-8 text ({exc.reason})")]) from None
    try:
        data = json.loads(text, object_pairs_hook=_no_duplicate_keys, parse_constant=_no_constants,
                          parse_int=_bounded_int)
    except json.JSONDecodeError as exc:
        raise RecipeError([FieldError("<document>", f"invalid JSON: {exc.msg}", exc.lineno)]) from None
    huge = _huge_ints(data)
    if huge:
        raise RecipeError(huge)
    return validate_recipe_data(data, allowed_import_modules=allowed), text


def parse_recipe_body(body: bytes, fmt: str, settings: Settings) -> SubmittedRecipe:
    """Bytes of a YAML or JSON recipe → SubmittedRecipe, or RecipeError naming each field (and YAML line)."""
    allowed = list(settings.allowed_import_modules)
    try:
        if fmt == "yaml":
            recipe = load_recipe(body, max_bytes=settings.max_recipe_bytes, allowed_import_modules=allowed)
            text = body.decode("utf-8")
        else:
            recipe, text = _load_json_recipe(body, allowed)
        normalised = recipe_to_dict(recipe)
    except RecursionError:
        raise RecipeError([FieldError("<document>", "the document is nested too deeply")]) from None
    except PydanticSerializationError as exc:
        raise RecipeError([FieldError("<recipe>", f"a value cannot be represented as JSON ({exc})")]) from None
    problems: list[FieldError] = []
    _reject_unstorable(normalised, "", problems)
    # what this server's settings refuse (``code.pip``); whether code paths exist is the scheduler's to check,
    # on its own host, at launch (``orchestrator.runtime_env``)
    problems += [FieldError(path, message) for path, message in code_refusals(recipe.code, settings)]
    if problems:
        raise RecipeError(problems)
    return SubmittedRecipe(recipe, normalised, content_hash(normalised), text)


INLINE_PARSE_BYTES = 8 * 1024
"""JSON recipes up to this size are parsed on the event loop: a typical one (~1 KiB) takes ~0.15 ms, less CPU than
the worker-thread hop would, and this size bounds the worst case to a few ms. YAML (a much slower parser, and the
one a "bomb" targets) and larger bodies are parsed in a worker thread."""


async def read_recipe_body(request: Request, settings: SettingsDep) -> SubmittedRecipe:
    """Check the content type (415), then read (``BodyLimitMiddleware`` stops an oversize body with a 413 before
    any of it is parsed) and parse (off the event loop unless it is a small JSON body)."""
    media = media_type(request)
    fmt = RECIPE_MEDIA_TYPES.get(media)
    if fmt is None:
        raise ApiError(
            415,
            f"send the recipe as one of {sorted(RECIPE_MEDIA_TYPES)}, not {media or 'no content type'!r}",
            slug="unsupported-media-type",
        )
    body = await request.body()
    if fmt == "json" and len(body) <= INLINE_PARSE_BYTES:
        return parse_recipe_body(body, fmt, settings)
    return await run_in_threadpool(parse_recipe_body, body, fmt, settings)


RecipeBody = Annotated[SubmittedRecipe, Depends(read_recipe_body)]

_RECIPE_EXAMPLE_YAML = """\
apiVersion: ballast/v1
kind: StabilityRecipe
name: tiny-gpt-demo
model: {name: tiny_gpt, n_layers: 2, d_model: 64}
data: {name: markov, vocab_size: 64}
training: {max_steps: 200, batch_size: 16}
optimizer: {name: adamw, lr: 0.003}
clipping: {method: global_norm, max_norm: 1.0}
"""
_RECIPE_EXAMPLE_JSON: dict[str, Any] = yaml.safe_load(_RECIPE_EXAMPLE_YAML)


def recipe_request_body(description: str) -> dict[str, Any]:
    """The OpenAPI ``requestBody`` of an endpoint that takes a recipe (read by ``read_recipe_body``)."""
    ref = {"$ref": "#/components/schemas/Recipe"}
    content: dict[str, Any] = {}
    for media, fmt in RECIPE_MEDIA_TYPES.items():
        example = _RECIPE_EXAMPLE_JSON if fmt == "json" else _RECIPE_EXAMPLE_YAML
        content[media] = {"schema": ref, "example": example}
    return {"requestBody": {"required": True, "description": description, "content": content}}
