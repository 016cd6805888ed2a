"""`ballast db upgrade|downgrade|current`: apply the Alembic migrations to the configured database."""

from __future__ import annotations

import typer
from alembic import command

import migrations
from api.cli.app import app
from orchestrator.settings import get_settings

db_app = typer.Typer(help="Database schema migrations.", no_args_is_help=True)
app.add_typer(db_app, name="db")


def redacted_url(url: str) -> str:
    """A database URL fit for a message: the password hidden."""
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


@db_app.command("upgrade")
def upgrade(revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Migrate the database (BALLAST_DATABASE_URL) up to REVISION."""
    url = get_settings().database_url
    migrations.upgrade(url, revision)
    typer.echo(f"database at {revision}: {redacted_url(url)}")


@db_app.command("downgrade")
def downgrade(revision: str = typer.Argument(..., help="Target revision (e.g. base).")) -> None:
    """Migrate the database down to REVISION."""
    url = get_settings().database_url
    migrations.downgrade(url, revision)
    typer.echo(f"database at {revision}: {redacted_url(url)}")


@db_app.command("current")
def current() -> None:
    """Print the database's current revision."""
    command.current(migrations.alembic_config(get_settings().database_url))
