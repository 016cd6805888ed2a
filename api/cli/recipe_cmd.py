"""`ballast recipe validate|schema`: check recipes locally, without a server."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer

from api.cli.app import app
from contracts.recipe import RecipeError, load_recipe, recipe_json_schema
from orchestrator.settings import get_settings

recipe_app = typer.Typer(help="Validate recipes and print their JSON Schema.", no_args_is_help=True)
app.add_typer(recipe_app, name="recipe")


@recipe_app.command("validate")
def validate(
    files: list[Path] = typer.Argument(..., help="Recipe YAML files."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable results."),
) -> None:
    """Validate recipe files. Exit code 2 if any is invalid; each error names the field (and line)."""
    settings = get_settings()
    results: list[dict[str, Any]] = []
    failed = False
    for path in files:
        try:
            text = path.read_bytes()
        except OSError as exc:
            results.append({"file": str(path), "valid": False, "errors": [f"<file>: {exc.strerror}"]})
            failed = True
            continue
        try:
            recipe = load_recipe(
                text, max_bytes=settings.max_recipe_bytes, allowed_import_modules=settings.allowed_import_modules
            )
        except RecipeError as exc:
            results.append({"file": str(path), "valid": False, "errors": [str(e) for e in exc.errors]})
            failed = True
            continue
        results.append({"file": str(path), "valid": True, "name": recipe.name, "warnings": recipe.warnings()})
    if as_json:
        typer.echo(json.dumps(results, indent=2))
    else:
        for r in results:
            if r["valid"]:
                typer.echo(f"{r['file']}: ok ({r['name']})")
                for w in r["warnings"]:
                    typer.echo(f"{r['file']}: warning: {w}", err=True)
            else:
                for e in r["errors"]:
                    typer.echo(f"{r['file']}: {e}", err=True)
    if failed:
        raise typer.Exit(2)


@recipe_app.command("schema")
def schema() -> None:
    """Print the recipe JSON Schema (for yaml-language-server: `# yaml-language-server: $schema=...`)."""
    sys.stdout.write(json.dumps(recipe_json_schema(), indent=2) + "\n")
