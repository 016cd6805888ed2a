"""The root Typer application; each ``*_cmd`` module registers its commands on it."""

from __future__ import annotations

import typer

app = typer.Typer(
    name="ballast",
    help="Ballast: detect training divergence, roll back to a healthy checkpoint, retry with tightened settings.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
