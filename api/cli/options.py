"""What every client command shares: the ``--url`` / ``--token`` / ``--json`` options, the run-id argument, the
client context that turns a refusal into one line per problem on stderr (exit code 2), and plain output."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer
from rich.console import Console

from api.cli.app import EXIT_ERROR
from api.client import DEFAULT_URL
from ballast import Client, ClientError

UrlOpt = Annotated[
    str | None,
    typer.Option("--url", envvar="BALLAST_URL", help=f"Ballast server URL (default {DEFAULT_URL}).",
                 show_default=False),
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar="BALLAST_TOKEN", help="API token (needed when the server has auth on).",
                 show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output (the API's JSON).")]
CursorOpt = Annotated[
    str | None, typer.Option("--cursor", help="`next` of a previous page.", show_default=False)
]
RunArg = Annotated[int, typer.Argument(help="Run id.", min=1, show_default=False)]

def console() -> Console:
    """A console for stdout, resolved at call time so tests capturing stdout (and pipes) get plain text."""
    return Console(highlight=False, soft_wrap=True)


def echo_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


@contextmanager
def connect(url: str | None, token: str | None, *, prefix: str = "error") -> Iterator[Client]:
    """A client; any ClientError becomes one line per problem on stderr and exit code 2."""
    client = Client(url, token)
    try:
        yield client
    except ClientError as exc:
        for line in exc.lines():
            typer.echo(f"{prefix}: {line}", err=True)
        raise typer.Exit(EXIT_ERROR) from None
    finally:
        client.close()
