"""The `ballast` command line. Importing the command modules registers their commands on ``app``."""

from __future__ import annotations

import typer
from pydantic import ValidationError

from api.cli import client_cmd, db_cmd, recipe_cmd, serve_cmd, token_cmd, train_cmd  # noqa: F401  (registration)
from api.cli.app import app
from orchestrator.settings import settings_error_lines


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
