"""`ballast db upgrade|downgrade|current`: apply the Alembic migrations to the configured database."""

from __future__ import annotations

import typer

import migrations
from api.cli.app import app, fail, first_line
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
    """Print the database's current revision (or say that it has none yet)."""
    from alembic.runtime.migration import MigrationContext
    from sqlalchemy import create_engine

    url = get_settings().database_url
    engine = create_engine(url)
    try:
        with engine.connect() as conn:
            revision = MigrationContext.configure(conn).get_current_revision()
    except Exception as exc:
        raise fail(f"cannot read the database at {redacted_url(url)}: {first_line(exc)}") from None
    finally:
        engine.dispose()
    head = command_head()
    if revision is None:
        typer.echo(f"no schema yet (revision: none; head: {head}); run `ballast db upgrade`: {redacted_url(url)}")
    else:
        note = " (head)" if revision == head else f" (head is {head}; run `ballast db upgrade`)"
        typer.echo(f"revision {revision}{note}: {redacted_url(url)}")


def command_head() -> str:
    """The newest migration this package ships."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(migrations.alembic_config("sqlite://")).get_current_head() or "none"
