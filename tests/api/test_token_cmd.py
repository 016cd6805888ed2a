"""`ballast token create|list|revoke`: tokens straight into the database; the printed token then works."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

import api.cli  # noqa: F401  (registers the commands)
from api.auth import hash_token
from api.cli.app import app
from orchestrator.settings import get_settings
from orchestrator.store.models import ApiToken
from tests.api.conftest import PEPPER


@pytest.fixture
def cli_env(db_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("BALLAST_DATABASE_URL", db_url)
    monkeypatch.setenv("BALLAST_TOKEN_PEPPER", PEPPER)
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def test_token_create_prints_a_working_token_once(
    cli_env: None, session_factory: sessionmaker[Session], make_client: Callable[..., TestClient]
) -> None:
    result = CliRunner().invoke(app, ["token", "create", "--name", "alice", "--scope", "read", "--scope", "submit"])
    assert result.exit_code == 0, result.output
    token = result.stdout.strip().splitlines()[-1]
    assert token.startswith("blst_")
    with session_factory() as s:
        row = s.scalars(sa.select(ApiToken)).one()
        assert (row.name, row.principal, row.scopes) == ("alice", "alice", ["read", "submit"])
        assert row.token_hash == hash_token(token, PEPPER)
    c = make_client(auth=True)
    r = c.get("/api/v1/runs", headers={"Authorization": f"Bearer {token}"})
    assert r.status_code == 200
    listed = CliRunner().invoke(app, ["token", "list", "--json"])
    assert listed.exit_code == 0
    assert token not in listed.stdout
    assert json.loads(listed.stdout)[0]["principal"] == "alice"


def test_token_create_json_with_principal(cli_env: None) -> None:
    result = CliRunner().invoke(
        app, ["token", "create", "--name", "ci", "--principal", "team-a", "--scope", "admin", "--json"]
    )
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["principal"] == "team-a" and info["scopes"] == ["admin"] and info["token"].startswith("blst_")


def test_token_create_rejects_unknown_scope(cli_env: None, session_factory: sessionmaker[Session]) -> None:
    result = CliRunner().invoke(app, ["token", "create", "--name", "x", "--scope", "root"])
    assert result.exit_code == 2
    assert "--scope must be one of read, submit, admin; got root" in result.output
    with session_factory() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(ApiToken)) == 0


def test_token_revoke(cli_env: None, make_client: Callable[..., TestClient]) -> None:
    created = json.loads(
        CliRunner().invoke(app, ["token", "create", "--name", "x", "--scope", "read", "--json"]).stdout
    )
    result = CliRunner().invoke(app, ["token", "revoke", str(created["id"])])
    assert result.exit_code == 0 and "revoked" in result.stdout
    r = make_client(auth=True).get("/api/v1/runs", headers={"Authorization": f"Bearer {created['token']}"})
    assert r.status_code == 401
    missing = CliRunner().invoke(app, ["token", "revoke", "999"])
    assert missing.exit_code == 1
