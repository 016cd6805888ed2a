"""Apply an attempt's overrides (``{"optimizer.lr": [old, new], ...}``) to a recipe.

The orchestrator and the in-place recovery path in the engine use this same function, so an attempt's
effective recipe is computed one way everywhere. The result is re-validated: an override can never produce a
recipe the schema would refuse.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from contracts.recipe import FieldError, Recipe, RecipeError, admitted_modules, recipe_to_dict, validate_recipe_data


def _new_value(path: str, change: Any) -> Any:
    """``[old, new]`` (the documented form) → new; a bare value is taken as the new value."""
    if isinstance(change, list | tuple):
        if len(change) != 2:
            raise RecipeError([FieldError(path, f"override must be [old, new], got {change!r}")])
        return change[1]
    return change


def get_path(doc: Any, path: str) -> Any:
    """The value at a dotted recipe path (``optimizer.lr``, ``faults.0.step``) of a recipe document."""
    node = doc
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def _set_path(doc: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node: Any = doc
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        where = ".".join(parts[: i + 1])
        if isinstance(node, dict):
            if part not in node:
                raise RecipeError([FieldError(path, f"no such recipe field {where!r}")])
            if last:
                node[part] = value
            else:
                node = node[part]
        elif isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError([FieldError(path, f"no such list index {where!r}")])
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
        else:
            raise RecipeError([FieldError(path, f"{'.'.join(parts[:i])!r} is not a section")])


def apply_overrides(
    recipe: Recipe,
    overrides: Mapping[str, Any] | None,
    *,
    allowed_import_modules: list[str] | None = None,
) -> Recipe:
    """A new recipe with each dotted path set to its new value; raises RecipeError naming a bad path or value.

    Import strings already in the recipe were admitted when it was accepted, so their modules are allowed
    again here unless the caller passes the operator's allow-list explicitly.
    """
    if not overrides:
        return recipe
    doc = recipe_to_dict(recipe)
    if allowed_import_modules is None:
        allowed_import_modules = admitted_modules(doc)
    for path, change in overrides.items():
        _set_path(doc, path, _new_value(path, change))
    return validate_recipe_data(doc, allowed_import_modules=allowed_import_modules)
