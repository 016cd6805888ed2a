"""`ballast submit RECIPE.yaml [--watch]`: submit a recipe as a run (always with an Idempotency-Key).

Every client command takes ``--url`` / ``BALLAST_URL`` and ``--token`` / ``BALLAST_TOKEN`` and ``--json`` for
machine-readable output (the server's response bodies, unchanged). Errors are one line each on stderr and exit
code 2; ``--watch`` exits 0 when the run succeeds and 1 when it fails or is cancelled.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from api.cli.app import EXIT_ERROR, app
from api.cli.options import JsonOpt, TokenOpt, UrlOpt, connect, echo_json
from api.cli.watch import watch as follow_run


def _read_recipe(path: Path) -> bytes:
    try:
        return sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
    except OSError as exc:
        typer.echo(f"{path}: cannot read: {exc.strerror}", err=True)
        raise typer.Exit(EXIT_ERROR) from None


@app.command("submit")
def submit(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file ('-' for stdin).", show_default=False)],
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Follow the run until it ends.")] = False,
    idempotency_key: Annotated[
        str | None,
        typer.Option("--idempotency-key", help="Resubmitting with the same key returns the same run.",
                     show_default=False),
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Submit a recipe as a run and print its id. The server validates it; each bad field is one line."""
    text = _read_recipe(recipe)
    with connect(url, token, prefix=str(recipe)) as client:
        sub = client.submit_run(text, idempotency_key=idempotency_key)
    run = sub.run
    if not watch:
        if as_json:
            echo_json(run)
        else:
            again = " (already submitted with this Idempotency-Key)" if not sub.created else ""
            typer.echo(f"run {run['id']} ({run['name']}): {run['state']}{again}")
        return
    raise typer.Exit(follow_run(url, token, int(run["id"]), as_json=as_json))
