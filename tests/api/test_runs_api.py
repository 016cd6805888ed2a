"""POST/GET /api/v1/runs, GET /runs/{id}, cancel and retry: through the real app on both backends."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

import orchestrator.store.db as db
from orchestrator.store.models import AnomalyRow, Attempt, CheckpointRow, Event, Run
from tests.api.conftest import YAML_RECIPE, post_yaml, seed_attempt, seed_run

RUNS = "/api/v1/runs"


def test_submit_creates_queued_run(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    r = post_yaml(client)
    assert r.status_code == 201
    body = r.json()
    assert r.headers["location"] == f"/api/v1/runs/{body['id']}"
    assert body["state"] == "queued"
    assert body["name"] == "demo"
    assert body["owner"] == "local"
    assert body["current_attempt"] == 0
    assert body["idempotency_key"] is None
    assert body["summary"] == {
        "best_loss": None, "last_step": None, "max_steps": 100, "retries_used": 0, "crash_restarts_used": 0,
        "anomalies_by_kind": {}, "anomalies_total": 0,
    }
    with session_factory() as s:
        run = s.get(Run, body["id"])
        assert run is not None and run.state == "queued" and run.recipe.text == YAML_RECIPE
        (ev,) = s.scalars(sa.select(Event).where(Event.run_id == run.id)).all()
        assert (ev.from_state, ev.to_state, ev.reason) == (None, "queued", "submitted")


def test_submit_invalid_recipe_creates_nothing(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    r = post_yaml(client, YAML_RECIPE.replace("max_steps: 100", "max_steps: 0"))
    assert r.status_code == 422
    assert r.json()["errors"][0]["path"] == "training.max_steps"
    with session_factory() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(Run)) == 0


def test_idempotent_submission_returns_the_same_run(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    first = post_yaml(client, **{"Idempotency-Key": "abc-123"})
    again = post_yaml(client, **{"Idempotency-Key": "abc-123"})
    assert first.status_code == 201
    assert again.status_code == 200
    assert again.json()["id"] == first.json()["id"]
    assert again.json()["idempotency_key"] == "abc-123"
    other = post_yaml(client, **{"Idempotency-Key": "another"})
    assert other.status_code == 201 and other.json()["id"] != first.json()["id"]
    with session_factory() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(Run)) == 2


def test_idempotency_key_reused_for_a_different_recipe_is_409(client: TestClient) -> None:
    assert post_yaml(client, **{"Idempotency-Key": "k"}).status_code == 201
    r = post_yaml(client, YAML_RECIPE.replace("lr: 0.003", "lr: 0.001"), **{"Idempotency-Key": "k"})
    assert r.status_code == 409
    assert r.json()["type"] == "urn:ballast:problem:idempotency-key-reused"


def test_concurrent_submissions_with_one_key_make_one_run(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    with ThreadPoolExecutor(6) as pool:
        responses = list(pool.map(lambda _: post_yaml(client, **{"Idempotency-Key": "race"}), range(6)))
    assert sorted(r.status_code for r in responses).count(201) == 1
    assert {r.status_code for r in responses} <= {200, 201}
    assert len({r.json()["id"] for r in responses}) == 1
    with session_factory() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(Run)) == 1


def test_idempotency_key_is_per_owner(
    make_client: Callable[..., TestClient], make_token: Callable[..., dict[str, str]]
) -> None:
    c = make_client(auth=True)
    alice = make_token("alice", "submit", "read")
    bob = make_token("bob", "submit", "read")
    a = post_yaml(c, **alice, **{"Idempotency-Key": "same"})
    b = post_yaml(c, **bob, **{"Idempotency-Key": "same"})
    assert a.status_code == b.status_code == 201
    assert a.json()["id"] != b.json()["id"]


def test_bad_idempotency_key_is_422(client: TestClient) -> None:
    r = post_yaml(client, **{"Idempotency-Key": "x" * 201})
    assert r.status_code == 422
    assert r.json()["errors"][0]["path"] == "header.Idempotency-Key"


def test_list_newest_first_with_stable_cursor_over_equal_timestamps(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    same = datetime(2026, 1, 1, 12, 0, 0, tzinfo=UTC)
    ids = [seed_run(session_factory, created_at=same) for _ in range(5)]
    newer = seed_run(session_factory, created_at=datetime(2026, 1, 2, tzinfo=UTC))
    seen: list[int] = []
    cursor = None
    pages = 0
    while True:
        params: dict[str, str | int] = {"limit": 2}
        if cursor:
            params["cursor"] = cursor
        r = client.get(RUNS, params=params)
        assert r.status_code == 200
        body = r.json()
        assert body["count"] == (6 if pages == 0 else 7)  # count is live; the cursor's position is not
        seen += [x["id"] for x in body["data"]]
        pages += 1
        cursor = body["next"]
        if cursor is None:
            break
        # a run created after the listing started must not shift the pages that follow
        if pages == 1:
            seed_run(session_factory, created_at=datetime(2026, 1, 3, tzinfo=UTC))
    assert seen == [newer, *sorted(ids, reverse=True)]
    assert pages == 3


def test_list_filters(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    a = seed_run(session_factory, name="alpha", state="running")
    b = seed_run(session_factory, name="beta", state="failed")
    c = seed_run(session_factory, name="alpha", state="succeeded")
    d = seed_run(session_factory, name="gamma", state="queued", owner="someone")

    def ids(**params: object) -> list[int]:
        r = client.get(RUNS, params=params)
        assert r.status_code == 200, r.text
        assert r.json()["count"] == len(r.json()["data"])
        return [x["id"] for x in r.json()["data"]]

    assert ids(state="running") == [a]
    assert ids(state=["failed", "succeeded"]) == [c, b]
    assert ids(name="alpha") == [c, a]
    assert ids(name="alpha", state="running") == [a]
    assert ids(owner="someone") == [d]  # auth off: "local" is an admin and may filter by owner
    assert ids(name="nothing") == []


@pytest.mark.parametrize(
    "params, path",
    [({"state": "bogus"}, "query.state.0"), ({"limit": 0}, "query.limit"), ({"cursor": "!!notacursor"}, "query.cursor"),
     ({"name": "Bad Name"}, "query.name")],
)
def test_list_bad_parameters_are_422_with_path(client: TestClient, params: dict[str, object], path: str) -> None:
    r = client.get(RUNS, params=params)
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["errors"][0]["path"] == path


def test_get_run_detail_with_summary(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    run_id = seed_run(session_factory, state="recovering")
    a1 = seed_attempt(session_factory, run_id, 1, state="diverged")
    seed_attempt(session_factory, run_id, 2, state="running", kind="numeric_retry",
                 overrides={"optimizer.lr": [0.003, 0.0015]})
    with session_factory() as s:
        for seq, kind in enumerate(["grad_norm_spike", "grad_norm_spike", "loss_spike"], start=1):
            s.add(AnomalyRow(run_id=run_id, attempt_id=a1, seq=seq, step=40 + seq, kind=kind, detector=kind,
                             value=10.0, threshold=6.0, action="rollback"))
        run = s.get(Run, run_id)
        assert run is not None
        run.best_loss, run.last_step, run.retries_used, run.reason = 2.5, 57, 1, "loss spike at step 43"
        s.commit()
    r = client.get(f"{RUNS}/{run_id}")
    assert r.status_code == 200
    body = r.json()
    assert body["state"] == "recovering"
    assert body["current_attempt"] == 2
    assert body["reason"] == "loss spike at step 43"
    assert body["attempt"]["number"] == 2
    assert body["attempt"]["kind"] == "numeric_retry"
    assert body["attempt"]["overrides"] == {"optimizer.lr": [0.003, 0.0015]}
    assert body["summary"] == {
        "best_loss": 2.5, "last_step": 57, "max_steps": 100, "retries_used": 1, "crash_restarts_used": 0,
        "anomalies_by_kind": {"grad_norm_spike": 2, "loss_spike": 1}, "anomalies_total": 3,
    }
    assert body["recipe"]["optimizer"]["lr"] == 0.003
    listed = client.get(RUNS).json()["data"][0]
    assert listed["summary"]["anomalies_by_kind"] == {"grad_norm_spike": 2, "loss_spike": 1}


def test_get_run_on_postgresql_reads_on_the_loop_and_a_lost_connection_is_a_503_once(
    client: TestClient, session_factory: sessionmaker[Session], db_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On PostgreSQL the app's lifespan opens its read pool and ``GET /runs/{id}`` uses it (the backend that served
    the read is one of the pool's); when that connection's server side goes away, the next GET is a 503 problem
    (not a 500) and the one after it is served again. On SQLite there is no read pool."""
    pool = client.app.state.read_pool  # type: ignore[attr-defined]
    if not db_url.startswith("postgresql"):
        assert pool is None
        return
    assert pool is not None
    monkeypatch.setattr(db, "PING_IDLE_S", 3600.0)  # in use a moment ago: not pinged before the next read
    run_id = seed_run(session_factory)
    assert client.get(f"{RUNS}/{run_id}").status_code == 200
    with session_factory() as s:  # the pool's one connection so far, by its application name
        pids = s.scalars(sa.text("SELECT pid FROM pg_stat_activity WHERE application_name = :name "
                                 "AND datname = current_database()"), {"name": db.READ_POOL_NAME}).all()
        assert len(pids) == 1
        s.execute(sa.text("SELECT pg_terminate_backend(:pid)"), {"pid": pids[0]})
    r = client.get(f"{RUNS}/{run_id}")
    assert r.status_code == 503
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"] == "urn:ballast:problem:database-unavailable"
    assert client.get(f"{RUNS}/{run_id}").json()["id"] == run_id


def test_get_missing_run_is_404_problem(client: TestClient) -> None:
    for path in (f"{RUNS}/999", f"{RUNS}/999/attempts", f"{RUNS}/999/anomalies", f"{RUNS}/999/checkpoints",
                 f"{RUNS}/999/metrics", f"{RUNS}/999/events"):
        r = client.get(path)
        assert r.status_code == 404, path
        assert r.headers["content-type"] == "application/problem+json"
        assert r.json() == {"type": "urn:ballast:problem:not-found", "title": "Not Found", "status": 404,
                            "detail": "run 999 not found", "instance": path}


def test_huge_run_id_is_422_not_a_database_error(client: TestClient) -> None:
    r = client.get(f"{RUNS}/{2**40}")
    assert r.status_code == 422
    assert r.json()["errors"][0]["path"] == "path.run_id"


def test_cancel_queued_run_is_immediate(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    run_id = post_yaml(client).json()["id"]
    r = client.post(f"{RUNS}/{run_id}/cancel")
    assert r.status_code == 200
    assert r.json()["state"] == "cancelled"
    assert r.json()["reason"] == "cancelled by local"
    assert r.json()["ended_at"] is not None


def test_cancel_active_run_is_requested(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    run_id = seed_run(session_factory, state="running")
    r = client.post(f"{RUNS}/{run_id}/cancel")
    assert r.status_code == 202
    assert r.json()["state"] == "running"
    assert r.json()["cancel_requested"] is True
    with session_factory() as s:
        run = s.get(Run, run_id)
        assert run is not None and run.cancel_requested and run.state == "running"


@pytest.mark.parametrize("state", ["succeeded", "failed", "cancelled"])
def test_cancel_finished_run_is_409(client: TestClient, session_factory: sessionmaker[Session], state: str) -> None:
    run_id = seed_run(session_factory, state=state)
    r = client.post(f"{RUNS}/{run_id}/cancel")
    assert r.status_code == 409
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"] == "urn:ballast:problem:illegal-transition"
    assert r.json()["detail"] == f"the run is {state}; it cannot become cancelled"


def test_retry_failed_run_resumes_from_newest_healthy_checkpoint(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = seed_run(session_factory, state="failed")
    a1 = seed_attempt(session_factory, run_id, 1, state="diverged", overrides={"clipping.max_norm": [1.0, 0.5]})
    with session_factory() as s:
        s.add_all([
            CheckpointRow(run_id=run_id, attempt_id=a1, step=20, uri="file:///c/20", sha256="a" * 64, healthy=True),
            CheckpointRow(run_id=run_id, attempt_id=a1, step=40, uri="file:///c/40", sha256="b" * 64, healthy=True),
            CheckpointRow(run_id=run_id, attempt_id=a1, step=60, uri="file:///c/60", sha256="c" * 64, healthy=False),
        ])
        s.commit()
    r = client.post(f"{RUNS}/{run_id}/retry", json={"overrides": {"optimizer.lr": 0.001}})
    assert r.status_code == 202, r.text
    body = r.json()
    assert body["run"]["state"] == "queued"
    assert body["run"]["current_attempt"] == 2
    att = body["attempt"]
    assert (att["number"], att["state"], att["kind"], att["resume_step"]) == (2, "pending", "manual", 40)
    # the previous attempt's tightened clip is kept, the new LR applied; both as [recipe value, new value]
    assert att["overrides"] == {"clipping.max_norm": [1.0, 0.5], "optimizer.lr": [0.003, 0.001]}
    assert att["plan"]["resume_uri"] == "file:///c/40"
    with session_factory() as s:
        ev = s.scalars(sa.select(Event).where(Event.run_id == run_id).order_by(Event.id.desc())).first()
        assert ev is not None and (ev.from_state, ev.to_state) == ("failed", "queued")


def test_summary_max_steps_follows_a_retry_override(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    """After `runs retry --set training.max_steps=60` the run reports the steps its current attempt trains to, in
    every view that carries the summary (the recipe says max_steps 100)."""
    run_id = seed_run(session_factory, state="failed")
    seed_attempt(session_factory, run_id, 1, state="diverged")
    assert client.get(f"{RUNS}/{run_id}").json()["summary"]["max_steps"] == 100
    r = client.post(f"{RUNS}/{run_id}/retry", json={"overrides": {"training.max_steps": 60}})
    assert r.status_code == 202, r.text
    assert r.json()["attempt"]["overrides"] == {"training.max_steps": [100, 60]}
    assert r.json()["run"]["summary"]["max_steps"] == 60
    assert client.get(f"{RUNS}/{run_id}").json()["summary"]["max_steps"] == 60
    listed = [x for x in client.get(RUNS).json()["data"] if x["id"] == run_id]
    assert listed[0]["summary"]["max_steps"] == 60
    assert client.post(f"{RUNS}/{run_id}/cancel").json()["summary"]["max_steps"] == 60


def test_retry_without_body(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    run_id = seed_run(session_factory, state="cancelled")
    r = client.post(f"{RUNS}/{run_id}/retry")
    assert r.status_code == 202
    assert r.json()["attempt"]["overrides"] == {}
    assert r.json()["attempt"]["plan"]["resume_uri"] is None


def test_retry_bad_override_is_422_naming_it(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    run_id = seed_run(session_factory, state="failed")
    r = client.post(f"{RUNS}/{run_id}/retry", json={"overrides": {"optimizer.lrr": 0.1}})
    assert r.status_code == 422
    assert r.json()["errors"][0]["path"] == "overrides.optimizer.lrr"
    r = client.post(f"{RUNS}/{run_id}/retry", json={"overrides": {"optimizer.lr": -1}})
    assert r.status_code == 422
    assert r.json()["errors"] == [{"path": "overrides.optimizer.lr", "message": "Input should be greater than 0"}]
    r = client.post(f"{RUNS}/{run_id}/retry", json={"overides": {}})
    assert r.status_code == 422
    assert r.json()["errors"][0]["path"] == "overides"
    with session_factory() as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(Attempt)) == 0
        run = s.get(Run, run_id)
        assert run is not None and run.state == "failed"


@pytest.mark.parametrize("state", ["queued", "running", "succeeded"])
def test_retry_in_other_states_is_409(client: TestClient, session_factory: sessionmaker[Session], state: str) -> None:
    run_id = seed_run(session_factory, state=state)
    r = client.post(f"{RUNS}/{run_id}/retry")
    assert r.status_code == 409
    assert r.json()["detail"] == f"the run is {state}; it cannot become queued"


def test_retry_body_must_be_json(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    run_id = seed_run(session_factory, state="failed")
    r = client.post(f"{RUNS}/{run_id}/retry", content=b"overrides: {}", headers={"content-type": "application/yaml"})
    assert r.status_code == 415


def test_cancel_queued_retry_cancels_its_pending_attempt(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = seed_run(session_factory, state="failed")
    assert client.post(f"{RUNS}/{run_id}/retry").status_code == 202
    r = client.post(f"{RUNS}/{run_id}/cancel")
    assert r.status_code == 200 and r.json()["state"] == "cancelled"
    attempt = client.get(f"{RUNS}/{run_id}/attempts/1").json()
    assert attempt["state"] == "cancelled"


def test_retry_body_that_is_not_utf8_is_422(client: TestClient, session_factory: sessionmaker[Session]) -> None:
    run_id = seed_run(session_factory, state="failed")
    r = client.post(f"{RUNS}/{run_id}/retry", content=b'{"overrides": "\xff\xfe"}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["errors"] == [{"path": "<body>", "message": "cannot be parsed (UnicodeDecodeError)"}]


def test_retry_body_with_invalid_json_names_the_body(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = seed_run(session_factory, state="failed")
    r = client.post(f"{RUNS}/{run_id}/retry", content=b'{"overrides": ', headers={"content-type": "application/json"})
    assert r.status_code == 422
    (err,) = r.json()["errors"]
    assert err["path"] == "<body>" and err["message"].startswith("invalid JSON")
