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


def first_line(exc: BaseException) -> str:
    """An exception as one line for a message: its text's first line, else its type's name."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
