"""The root Typer application (each ``*_cmd`` module registers its commands on it), and how a command refuses."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="ballast",
    help="Ballast: detect training divergence, roll back to a healthy checkpoint, retry with tightened settings.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)

EXIT_ERROR = 2
"""Exit code for refused input: a bad recipe, option or setting, a refused request, an unreachable server."""


def fail(message: str, code: int = EXIT_ERROR) -> typer.Exit:
    """``error: <message>`` on stderr; raise the returned ``typer.Exit`` to end the command with ``code``."""
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)
