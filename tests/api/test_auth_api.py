"""Bearer tokens, scopes and tenancy: 401 without a token, 403 without the scope, 404 for others' runs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from api.auth import hash_token
from orchestrator.settings import Settings
from orchestrator.store.models import ApiToken
from tests.api.conftest import PEPPER, post_yaml, seed_attempt, seed_run

RUNS = "/api/v1/runs"
Client = Callable[..., TestClient]
Token = Callable[..., dict[str, str]]


def test_missing_token_is_401_with_challenge(make_client: Client) -> None:
    c = make_client(auth=True)
    for method, path in [("GET", RUNS), ("POST", RUNS), ("GET", f"{RUNS}/1"), ("POST", "/api/v1/recipes:validate"),
                         ("GET", "/api/v1/tokens")]:
        r = c.request(method, path)
        assert r.status_code == 401, path
        assert r.headers["www-authenticate"] == 'Bearer realm="ballast"'
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json()["type"] == "urn:ballast:problem:unauthorized"


@pytest.mark.parametrize("header", ["Bearer blst_not-a-real-token", "Basic dXNlcjpwYXNz", "Bearer"])
def test_unknown_or_malformed_token_is_401(make_client: Client, header: str) -> None:
    r = make_client(auth=True).get(RUNS, headers={"Authorization": header})
    assert r.status_code == 401
    assert r.json()["status"] == 401


def test_wrong_scope_is_403(make_client: Client, make_token: Token) -> None:
    c = make_client(auth=True)
    reader = make_token("alice", "read")
    submitter = make_token("alice", "submit")
    r = post_yaml(c, **reader)
    assert r.status_code == 403
    assert r.json()["type"] == "urn:ballast:problem:forbidden"
    assert r.json()["detail"] == "this operation needs the 'submit' scope"
    assert c.get(RUNS, headers=submitter).status_code == 403
    assert c.get("/api/v1/tokens", headers=reader).status_code == 403


def test_runs_belong_to_the_tokens_principal(make_client: Client, make_token: Token) -> None:
    c = make_client(auth=True)
    alice = make_token("alice", "read", "submit")
    r = post_yaml(c, **alice)
    assert r.status_code == 201
    assert r.json()["owner"] == "alice"
    assert c.get(f"{RUNS}/{r.json()['id']}", headers=alice).json()["owner"] == "alice"


def test_other_tenants_runs_are_404_everywhere(
    make_client: Client, make_token: Token, session_factory: sessionmaker[Session]
) -> None:
    c = make_client(auth=True)
    bob = make_token("bob", "read", "submit")
    alice_run = seed_run(session_factory, owner="alice", state="running")
    seed_attempt(session_factory, alice_run, 1)
    for method, suffix in [("GET", ""), ("GET", "/attempts"), ("GET", "/attempts/1"), ("GET", "/anomalies"),
                           ("GET", "/checkpoints"), ("GET", "/metrics"), ("GET", "/events"), ("POST", "/cancel"),
                           ("POST", "/retry")]:
        r = c.request(method, f"{RUNS}/{alice_run}{suffix}", headers=bob)
        assert r.status_code == 404, suffix
        assert r.json()["detail"] == f"run {alice_run} not found"
    listed = c.get(RUNS, headers=bob).json()
    assert listed == {"data": [], "count": 0, "next": None}
    # naming another owner in the filter does not reveal their runs either
    assert c.get(RUNS, params={"owner": "alice"}, headers=bob).json()["count"] == 0


def test_admin_sees_and_filters_everyones_runs(
    make_client: Client, make_token: Token, session_factory: sessionmaker[Session]
) -> None:
    c = make_client(auth=True)
    admin = make_token("root", "admin")
    a = seed_run(session_factory, owner="alice")
    b = seed_run(session_factory, owner="bob")
    r = c.get(RUNS, headers=admin)
    assert r.status_code == 200
    assert [x["id"] for x in r.json()["data"]] == [b, a]
    assert [x["id"] for x in c.get(RUNS, params={"owner": "alice"}, headers=admin).json()["data"]] == [a]
    assert c.get(f"{RUNS}/{a}", headers=admin).json()["owner"] == "alice"
    assert c.post(f"{RUNS}/{a}/cancel", headers=admin).status_code == 200


def test_tokens_are_stored_hashed_with_the_pepper(
    make_client: Client, make_token: Token, session_factory: sessionmaker[Session]
) -> None:
    headers = make_token("alice", "read")
    token = headers["Authorization"].removeprefix("Bearer ")
    with session_factory() as s:
        (row,) = s.scalars(sa.select(ApiToken)).all()
        assert row.token_hash == hash_token(token, PEPPER)
        assert token not in (row.token_hash, row.name, row.principal)
        assert row.last_used_at is None
    assert make_client(auth=True).get(RUNS, headers=headers).status_code == 200
    with session_factory() as s:
        assert s.scalars(sa.select(ApiToken)).one().last_used_at is not None


def test_token_endpoints_issue_list_and_revoke(make_client: Client, make_token: Token) -> None:
    c = make_client(auth=True)
    admin = make_token("root", "admin")
    r = c.post("/api/v1/tokens", json={"name": "ci", "scopes": ["read", "submit"]}, headers=admin)
    assert r.status_code == 201
    created = r.json()
    assert created["principal"] == "ci" and created["scopes"] == ["read", "submit"]
    assert created["token"].startswith("blst_")
    new = {"Authorization": f"Bearer {created['token']}"}
    assert c.get(RUNS, headers=new).status_code == 200
    listed = c.get("/api/v1/tokens", headers=admin).json()
    assert listed["count"] == 2
    assert all("token" not in t for t in listed["data"])
    r = c.delete(f"/api/v1/tokens/{created['id']}", headers=admin)
    assert r.status_code == 200 and r.json()["revoked_at"] is not None
    assert c.get(RUNS, headers=new).status_code == 401
    assert c.delete("/api/v1/tokens/9999", headers=admin).status_code == 404
    bad = c.post("/api/v1/tokens", json={"name": "x", "scopes": ["root"]}, headers=admin)
    assert bad.status_code == 422
    assert bad.json()["errors"][0]["path"] == "scopes.0"


def test_auth_off_is_the_local_admin(client: TestClient) -> None:
    r = post_yaml(client)
    assert r.status_code == 201
    assert r.json()["owner"] == "local"


def test_auth_off_refuses_a_non_loopback_bind(tmp_path: Path) -> None:
    settings = Settings(database_url=f"sqlite:///{tmp_path}/x.db", auth_mode="off", bind_host="0.0.0.0")
    with pytest.raises(ValueError, match="only allowed on a loopback bind"):
        create_app(settings)
    # with tokens (and a real pepper) the same bind is fine
    create_app(Settings(database_url=f"sqlite:///{tmp_path}/x.db", auth_mode="token", bind_host="0.0.0.0",
                        token_pepper="a-real-secret"))


def test_probes_need_no_token(make_client: Client) -> None:
    c = make_client(auth=True)
    assert c.get("/healthz").status_code == 200
    assert c.get("/readyz").status_code == 200
    assert c.get("/metrics").status_code == 200


def test_verified_tokens_are_cached_briefly(
    make_client: Client, make_token: Token, session_factory: sessionmaker[Session]
) -> None:
    c = make_client(auth=True)
    cache = c.app.state.token_cache  # type: ignore[attr-defined]  # TestClient.app is typed as an ASGI callable
    headers = make_token("alice", "read")
    assert c.get(RUNS, headers=headers).status_code == 200
    with session_factory() as s:  # revoked behind this server's back (the CLI, another process)
        s.scalars(sa.select(ApiToken)).one().revoked_at = sa.func.now()
        s.commit()
    assert c.get(RUNS, headers=headers).status_code == 200  # still within the cache's TTL
    later = cache.clock() + cache.ttl + 1
    cache.clock = lambda: later
    assert c.get(RUNS, headers=headers).status_code == 401
