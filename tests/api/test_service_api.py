"""Probes, Prometheus metrics, OpenAPI/docs and the generic problem responses (404, 405)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from orchestrator.settings import Settings
from orchestrator.store.db import make_engine, make_session_factory
from orchestrator.store.models import AnomalyRow
from tests.api.conftest import post_yaml, seed_attempt, seed_run


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_healthz(client: TestClient) -> None:
    r = client.get("/healthz")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_readyz_ok_and_unavailable(client: TestClient, tmp_path: Path) -> None:
    r = client.get("/readyz")
    assert r.status_code == 200
    ray = sys.modules.get("ray")
    ray_in_use = ray is not None and ray.is_initialized()  # another test of this session may have started it
    assert r.json() == {"status": "ok", "checks": {"database": "ok", "ray": "ok" if ray_in_use else "skipped"}}
    # a database that cannot be opened, and a Ray address where nothing listens
    bad_url = f"sqlite:///{tmp_path}/missing-dir/sub/x.db"
    engine = sa.create_engine(bad_url)
    app = create_app(Settings(database_url=bad_url, ray_address="127.0.0.1:1"), make_session_factory(engine))
    with TestClient(app) as c:
        r = c.get("/readyz")
    engine.dispose()
    assert r.status_code == 503
    body = r.json()
    assert body["status"] == "unavailable"
    assert body["checks"]["database"].startswith("error: OperationalError")
    if not ray_in_use:  # an address where nothing listens (with Ray running in-process, that Ray is checked)
        assert body["checks"]["ray"].startswith("error:")


def test_prometheus_metrics_count_runs_anomalies_recoveries_and_requests(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    post_yaml(client)
    run_id = seed_run(session_factory, state="recovering")
    a1 = seed_attempt(session_factory, run_id, 1, state="diverged")
    seed_attempt(session_factory, run_id, 2, state="running", kind="numeric_retry")
    with session_factory() as s:
        for seq in (1, 2):
            s.add(AnomalyRow(run_id=run_id, attempt_id=a1, seq=seq, step=seq, kind="grad_norm_spike",
                             detector="g", action="rollback"))
        s.commit()
    assert client.get(f"/api/v1/runs/{run_id}").status_code == 200
    assert client.get("/api/v1/runs/424242").status_code == 404
    r = client.get("/metrics")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    m = _samples(r.text)
    assert m[("ballast_runs", (("state", "queued"),))] == 1
    assert m[("ballast_runs", (("state", "recovering"),))] == 1
    assert m[("ballast_runs", (("state", "failed"),))] == 0
    assert m[("ballast_attempts", (("state", "running"),))] == 1
    assert m[("ballast_anomalies_total", (("kind", "grad_norm_spike"),))] == 2
    assert m[("ballast_recoveries_total", (("kind", "numeric_retry"),))] == 1
    assert m[("ballast_recoveries_total", (("kind", "crash_restart"),))] == 0
    route = (("method", "GET"), ("route", "/api/v1/runs/{run_id}"))
    assert m[("ballast_http_request_duration_seconds_count", (*route, ("status", "200")))] == 1
    assert m[("ballast_http_request_duration_seconds_count", (*route, ("status", "404")))] == 1
    assert m[("ballast_http_request_duration_seconds_count",
              (("method", "POST"), ("route", "/api/v1/runs"), ("status", "201")))] == 1


def test_each_app_has_its_own_registry(make_client: Callable[..., TestClient]) -> None:
    a, b = make_client(), make_client()
    a.get("/healthz")
    text_b = b.get("/metrics").text
    assert 'route="/healthz"' not in text_b


def test_unknown_path_and_method_are_problems(client: TestClient) -> None:
    r = client.get("/api/v1/nothing-here")
    assert r.status_code == 404
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json() == {"type": "about:blank", "title": "Not Found", "status": 404, "instance": "/api/v1/nothing-here"}
    r = client.delete("/api/v1/runs")
    assert r.status_code == 405
    assert r.headers["allow"] == "GET, POST"
    assert r.json()["title"] == "Method Not Allowed"


def test_openapi_documents_every_endpoint_with_examples(client: TestClient) -> None:
    r = client.get("/openapi.json")
    assert r.status_code == 200
    spec = r.json()
    paths = spec["paths"]
    for p in ["/api/v1/recipes:validate", "/api/v1/runs", "/api/v1/runs/{run_id}", "/api/v1/runs/{run_id}/cancel",
              "/api/v1/runs/{run_id}/retry", "/api/v1/runs/{run_id}/attempts", "/api/v1/runs/{run_id}/anomalies",
              "/api/v1/runs/{run_id}/checkpoints", "/api/v1/runs/{run_id}/metrics", "/api/v1/runs/{run_id}/events",
              "/healthz", "/readyz", "/metrics"]:
        assert p in paths, p
    body = paths["/api/v1/runs"]["post"]["requestBody"]["content"]
    assert set(body) == {"application/json", "application/yaml", "application/x-yaml", "text/yaml"}
    assert body["application/yaml"]["example"].startswith("apiVersion: ballast/v1")
    assert body["application/json"]["example"]["optimizer"] == {"name": "adamw", "lr": 0.003}
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/Recipe"}
    schemas = spec["components"]["schemas"]
    assert "Recipe" in schemas and "Problem" in schemas and "Optimizer" in schemas
    assert "422" in paths["/api/v1/runs"]["post"]["responses"]
    assert "application/problem+json" in paths["/api/v1/runs"]["post"]["responses"]["413"]["content"]
    assert spec["components"]["securitySchemes"]["BearerToken"]["scheme"] == "bearer"


def test_docs_page(client: TestClient) -> None:
    r = client.get("/docs")
    assert r.status_code == 200
    assert "swagger" in r.text.lower()


def test_lifespan_builds_the_engine_from_settings(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/lifespan.db"
    import migrations

    migrations.upgrade(url)
    entered: list[str] = []

    from contextlib import asynccontextmanager
    from typing import Any

    @asynccontextmanager
    async def hook(app: Any) -> Any:
        entered.append("in")
        assert app.state.session_factory is not None  # the database is set up before hooks run
        yield
        entered.append("out")

    app = create_app(Settings(database_url=url), hooks=[hook])
    with TestClient(app) as c:
        assert c.get("/readyz").json()["checks"]["database"] == "ok"
        assert post_yaml(c).status_code == 201
    assert entered == ["in", "out"]
    assert app.state.session_factory is None  # disposed at shutdown
    engine = make_engine(url)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM runs")).scalar() == 1
    engine.dispose()


def test_requests_beyond_the_pool_wait_instead_of_timing_out(
    db_url: str, tmp_path: Path, make_token: Callable[..., dict[str, str]]
) -> None:
    """More concurrent requests than pooled connections: each holds its connection across two worker threads
    (auth, then the route), so without the limit in ``get_session`` they could starve each other."""
    from concurrent.futures import ThreadPoolExecutor

    from api.deps import _pool_capacity
    from tests.api.conftest import settings_for

    engine = make_engine(db_url, pool_size=2, max_overflow=0, pool_timeout=5)
    factory = make_session_factory(engine)
    assert _pool_capacity(factory) == 2
    headers = make_token("alice", "read", "submit")
    app = create_app(settings_for(db_url, tmp_path, auth_mode="token"), factory)
    app.state.token_cache.ttl = -1  # every request queries its token: two pooled uses per request
    with TestClient(app) as c, ThreadPoolExecutor(12) as pool:
        statuses = list(pool.map(lambda _: post_yaml(c, **headers).status_code, range(24)))
    engine.dispose()
    assert statuses == [201] * 24
