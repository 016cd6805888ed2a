"""Text → ``Recipe`` and back: the safe YAML loader, field errors with lines, serialisation, JSON Schema.

``load_recipe`` is the only way text becomes a ``Recipe``: it enforces a size limit before parsing, refuses YAML
aliases and duplicate keys, and reports every error with its field path and, where known, its line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import ValidationError

from contracts.recipe.base import DEFAULT_MAX_RECIPE_BYTES
from contracts.recipe.document import CrossFieldErrors, Recipe


@dataclass(frozen=True)
class FieldError:
    path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f" (line {self.line})" if self.line else ""
        return f"{self.path}: {self.message}{where}"


class RecipeError(ValueError):
    """A recipe that cannot be accepted; ``errors`` names each field and problem."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across Ray's process boundary
        return (type(self), (self.errors,))


class _NoAliasLoader(yaml.SafeLoader):
    """Safe loader that refuses aliases (no billion-laughs) and duplicate keys."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.constructor.ConstructorError(
                None, None, "YAML aliases are not allowed in recipes", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _line_of(root: Any, loc: tuple[Any, ...]) -> int | None:
    """Walk a composed YAML node tree along a pydantic error location and return its 1-based line."""
    node = root
    line: int | None = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == part:
                    nxt = v
                    line = k.start_mark.line + 1
                    break
            if nxt is None:
                return line
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            # discriminator tags (e.g. 'tiny_gpt') appear in pydantic locs but not in the document
            continue
    return line


_TAG_PARTS = {"tiny_gpt", "deep_mlp", "rnn", "linear", "custom", "markov", "regression", "sequence", "nan_loss",
              "grad_scale", "batch_scale", "kill_worker", "hang", "corrupt_checkpoint"}


def _document_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Drop the union tags pydantic inserts after ``model``, ``data`` and ``faults.N`` (they are not keys)."""
    out: list[Any] = []
    for i, part in enumerate(loc):
        prev = loc[i - 1] if i else None
        after_union = prev in ("model", "data") and i == 1 or (isinstance(prev, int) and i == 2 and loc[0] == "faults")
        if part in _TAG_PARTS and after_union:
            continue
        out.append(part)
    return tuple(out)


_STRICT_TYPE_ERRORS = frozenset({"int_type", "bool_type", "float_type", "string_type"})
_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
               dict: "a mapping", type(None): "null"}


def _describe(value: Any) -> str:
    """What a value of the wrong type was, for the error line: ``a string ('5')``, ``a boolean (true)``."""
    name = _TYPE_NAMES.get(type(value), type(value).__name__)
    if isinstance(value, bool):
        return f"{name} ({str(value).lower()})"
    if isinstance(value, int | float | str):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        return f"{name} ({shown})"
    return name


def _errors_from_validation(exc: ValidationError, root: Any) -> list[FieldError]:
    out: list[FieldError] = []
    for err in exc.errors(include_url=False):
        loc = _document_loc(tuple(err["loc"]))
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        cross = (err.get("ctx") or {}).get("error")
        if not loc and isinstance(cross, CrossFieldErrors):
            # cross-field errors carry their own paths (messages may contain "; " or ": " themselves)
            for path, m in cross.errors:
                parts = tuple(int(p) if p.isdigit() else p for p in path.split("."))
                out.append(FieldError(path, m, _line_of(root, parts) if root is not None else None))
            continue
        path = ".".join(str(p) for p in loc) or "<recipe>"
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        elif err["type"] in _STRICT_TYPE_ERRORS:
            msg += f", got {_describe(err.get('input'))}"
        out.append(FieldError(path, msg, _line_of(root, loc) if root is not None else None))
    return out


def validate_recipe_data(data: Any, *, allowed_import_modules: list[str] | None = None) -> Recipe:
    """Validate already-parsed data (e.g. a JSON body) into a Recipe, raising RecipeError."""
    return _validate(data, None, allowed_import_modules, "a recipe must be a mapping")


def parse_yaml(text: str | bytes, *, max_bytes: int = DEFAULT_MAX_RECIPE_BYTES) -> tuple[Any, Any]:
    """Parse YAML text safely; returns (data, composed node tree). Raises RecipeError."""
    size = len(text.encode("utf-8") if isinstance(text, str) else text)
    if size > max_bytes:
        raise RecipeError([FieldError("<document>", f"recipe is {size} bytes, over the limit of {max_bytes} bytes")])
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RecipeError([FieldError("<document>", f"not UTF-8 text ({exc.reason})")]) from None
    try:
        root = yaml.compose(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
        data = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else None
        raise RecipeError([FieldError("<document>", f"invalid YAML: {exc.problem}", line)]) from None
    except yaml.YAMLError as exc:
        raise RecipeError([FieldError("<document>", f"invalid YAML: {exc}")]) from None
    except ValueError as exc:  # e.g. an integer over Python's 4300-digit conversion limit
        raise RecipeError([FieldError("<document>", f"invalid number: {exc}")]) from None
    return data, root


def load_recipe(
    text: str | bytes,
    *,
    max_bytes: int = DEFAULT_MAX_RECIPE_BYTES,
    allowed_import_modules: list[str] | None = None,
) -> Recipe:
    """YAML (or JSON, a YAML subset) text → Recipe. Raises RecipeError naming each field and line."""
    data, root = parse_yaml(text, max_bytes=max_bytes)
    return _validate(data, root, allowed_import_modules, "a recipe must be a YAML mapping")


INT_LIMIT = 2**63 - 1
"""Every integer in a recipe must fit in 64 bits (seeds go to torch, steps to SQL BIGINT)."""


def _out_of_range(node: Any, loc: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Locations of integers that do not fit in 64 bits, anywhere in the document."""
    if isinstance(node, bool):
        return []
    if isinstance(node, int):
        return [loc] if abs(node) > INT_LIMIT else []
    if isinstance(node, dict):
        return [bad for k, v in node.items() for bad in _out_of_range(v, (*loc, k))]
    if isinstance(node, list):
        return [bad for i, v in enumerate(node) for bad in _out_of_range(v, (*loc, i))]
    return []


def _validate(data: Any, root: Any, allowed_import_modules: list[str] | None, not_a_mapping: str) -> Recipe:
    if not isinstance(data, dict):
        raise RecipeError([FieldError("<recipe>", not_a_mapping)])
    oversized = _out_of_range(data)
    if oversized:
        raise RecipeError([
            FieldError(".".join(str(p) for p in loc) or "<recipe>",
                       f"integer out of range: must fit in 64 bits (|x| <= {INT_LIMIT})",
                       _line_of(root, loc) if root is not None else None)
            for loc in oversized
        ])
    try:
        return Recipe.model_validate(data, context={"allowed_import_modules": allowed_import_modules or []})
    except ValidationError as exc:
        raise RecipeError(_errors_from_validation(exc, root)) from None


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    return recipe.model_dump(mode="json", by_alias=True)


def dump_recipe(recipe: Recipe) -> str:
    """Recipe → canonical YAML (all defaults filled, key order of the schema)."""
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=False)


def recipe_json_schema() -> dict[str, Any]:
    schema = Recipe.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Ballast StabilityRecipe (ballast/v1)"
    return schema
