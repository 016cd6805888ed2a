"""`ballast token create|list|revoke`: manage API tokens directly in the database (like `ballast db`).

This is how the first admin token comes to exist: it needs database access, not a token.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import typer
from sqlalchemy.orm import Session

import migrations
from api.auth import SCOPES, issue_token
from api.cli.app import app, fail, first_line
from api.cli.db_cmd import redacted_url
from api.cli.options import console
from api.cli.render import table, timestamp
from orchestrator.settings import get_settings
from orchestrator.store import repo
from orchestrator.store.db import make_engine, make_session_factory, transaction

token_app = typer.Typer(help="API tokens (stored hashed; a token is shown once, when created).",
                        no_args_is_help=True)
app.add_typer(token_app, name="token")


@contextmanager
def _session() -> Iterator[Session]:
    """One transaction on the configured database, migrated first (idempotent, as ``serve`` does: the first
    admin token is often made before the service ever started); the engine is disposed afterwards."""
    url = get_settings().database_url
    if url.startswith("sqlite"):
        get_settings().home.mkdir(parents=True, exist_ok=True)
    try:
        migrations.upgrade(url)
    except Exception as exc:  # unreachable server, bad URL, missing driver: one line, not a traceback
        raise fail(f"cannot migrate the database at {redacted_url(url)}: {first_line(exc)}") from None
    engine = make_engine(url)
    try:
        with transaction(make_session_factory(engine)) as session:
            yield session
    finally:
        engine.dispose()


@token_app.command("create")
def create(
    name: str = typer.Option(..., "--name", help="A label for the token (e.g. 'ci', 'alice-laptop')."),
    scope: list[str] = typer.Option(..., "--scope", help=f"Repeatable: {', '.join(SCOPES)}."),
    principal: str | None = typer.Option(None, "--principal", help="Who the token acts as (default: NAME)."),
    as_json: bool = typer.Option(False, "--json", help="Print machine-readable output."),
) -> None:
    """Create a token and print it once. Runs it submits belong to its principal."""
    bad = sorted(set(scope) - set(SCOPES))
    if bad:
        raise fail(f"--scope must be one of {', '.join(SCOPES)}; got {', '.join(bad)}")
    settings = get_settings()
    with _session() as session:
        row, token = issue_token(session=session, pepper=settings.token_pepper, name=name, principal=principal,
                                 scopes=scope)
        info: dict[str, Any] = {
            "id": row.id, "name": row.name, "principal": row.principal, "scopes": row.scopes, "token": token,
        }
    if as_json:
        typer.echo(json.dumps(info))
        return
    typer.echo(f"token {info['id']} for principal {info['principal']!r} (scopes: {', '.join(info['scopes'])}):")
    typer.echo(token)
    typer.echo("Store it now: it is not shown again (only its hash is kept).", err=True)


@token_app.command("list")
def list_(as_json: bool = typer.Option(False, "--json", help="Print machine-readable output.")) -> None:
    """List tokens (never their values)."""
    with _session() as session:
        rows: list[dict[str, Any]] = [
            {"id": t.id, "name": t.name, "principal": t.principal, "scopes": t.scopes,
             "created_at": t.created_at.isoformat(), "revoked": t.revoked_at is not None}
            for t in repo.list_tokens(session=session)
        ]
    if as_json:
        typer.echo(json.dumps(rows))
        return
    if not rows:
        typer.echo("no tokens (create one: ballast token create --name NAME --scope admin)")
        return
    out = table(("ID", "NAME", "PRINCIPAL", "SCOPES", "STATE", "CREATED"), right=("ID",),
                flexible=("NAME", "PRINCIPAL", "SCOPES"))
    for r in rows:
        out.add_row(str(r["id"]), r["name"], r["principal"], ",".join(r["scopes"]),
                    "revoked" if r["revoked"] else "active", timestamp(r["created_at"]))
    console().print(out)


@token_app.command("revoke")
def revoke(token_id: int = typer.Argument(..., help="Token id (from `ballast token list`).")) -> None:
    """Revoke a token: requests with it are refused from now on."""
    with _session() as session:
        row = repo.revoke_token(session=session, token_id=token_id)
    if row is None:
        raise fail(f"no token {token_id}", code=1)
    typer.echo(f"token {token_id} revoked")
