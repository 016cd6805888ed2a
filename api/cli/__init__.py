"""The `ballast` command line. Importing the command modules registers their commands on ``app``."""

from __future__ import annotations

import importlib

import typer
from pydantic import ValidationError

from api.cli.app import app
from orchestrator.settings import settings_error_lines

COMMAND_MODULES = (
    "submit_cmd", "runs_cmd", "inspect_cmd", "export_cmd", "db_cmd", "recipe_cmd", "serve_cmd", "token_cmd",
    "train_cmd",
)
"""Imported in this order: each registers its commands on ``app``, and ``ballast --help`` lists them so."""
for _name in COMMAND_MODULES:
    importlib.import_module(f"api.cli.{_name}")


def main() -> None:
    try:
        app()
    except ValidationError as exc:
        # a bad BALLAST_* variable is an operator error: name it in one line, no traceback
        if exc.title != "Settings":
            raise
        for line in settings_error_lines(exc):
            typer.echo(f"configuration error: {line}", err=True)
        raise SystemExit(2) from None
