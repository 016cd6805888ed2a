"""``/recipes``: validate a recipe without running it, and the recipe's JSON Schema."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from api.auth import ReadPrincipal
from api.bodies import RecipeBody, recipe_request_body
from api.errors import problem_responses
from api.schemas import RecipeValidation
from contracts.recipe import recipe_json_schema

router = APIRouter(tags=["recipes"])


@router.post(
    "/recipes:validate",
    summary="Validate a recipe (dry run)",
    description="Parses and validates a recipe exactly as `POST /runs` would, and returns it normalised (every "
    "default filled) with warnings and its content hash, or a 422 problem naming each invalid field (with its "
    "YAML line). The size limit is checked before parsing (413); YAML aliases and duplicate keys are refused.",
    responses=problem_responses(401, 403, 413, 415, 422),
    openapi_extra=recipe_request_body("A stability recipe (`apiVersion: ballast/v1`)."),
)
def validate_recipe(principal: ReadPrincipal, body: RecipeBody) -> RecipeValidation:
    return RecipeValidation(recipe=body.normalised, warnings=body.recipe.warnings(), content_hash=body.content_hash)


@router.get(
    "/recipes/schema",
    summary="The recipe's JSON Schema (draft 2020-12)",
    description="For editors and linters; the same schema the request bodies above refer to.",
    responses=problem_responses(401, 403),
)
def recipe_schema(principal: ReadPrincipal) -> dict[str, Any]:
    return recipe_json_schema()
