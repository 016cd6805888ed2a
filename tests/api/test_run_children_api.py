"""Attempts, anomalies, checkpoints and metric series of a run (rows inserted as the scheduler would)."""

from __future__ import annotations

import math

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.store.models import AnomalyRow, CheckpointRow, EvalPoint, MetricPoint
from tests.api.conftest import seed_attempt, seed_run

RUNS = "/api/v1/runs"


@pytest.fixture
def run_with_history(session_factory: sessionmaker[Session]) -> dict[str, int]:
    """Attempt 1 diverged at step 60 after a spike; attempt 2 resumed from step 40 and is running."""
    run_id = seed_run(session_factory, state="running")
    a1 = seed_attempt(session_factory, run_id, 1, state="diverged")
    a2 = seed_attempt(session_factory, run_id, 2, state="running", kind="numeric_retry",
                      overrides={"optimizer.lr": [0.003, 0.0015]})
    with session_factory() as s:
        for step in range(100):  # attempt 1: steps 0..99, a one-step spike at 60
            s.add(MetricPoint(run_id=run_id, attempt_id=a1, step=step, loss=3.0 - step * 0.01,
                              grad_norm=500.0 if step == 60 else 1.0, lr=0.003, skipped=step == 60))
        for step in range(40, 70):  # attempt 2 re-runs from step 40
            s.add(MetricPoint(run_id=run_id, attempt_id=a2, step=step, loss=2.0, grad_norm=0.9, lr=0.0015))
        kinds = ["grad_norm_spike", "loss_spike", "grad_norm_spike", "nonfinite", "grad_norm_spike"]
        for seq, (kind, step) in enumerate(zip(kinds, [58, 59, 60, 61, 62], strict=True), start=1):
            s.add(AnomalyRow(run_id=run_id, attempt_id=a1, seq=seq, step=step, kind=kind, detector=kind,
                             value=math.inf if kind == "nonfinite" else 9.5, threshold=6.0, action="rollback",
                             details={"z": 9.5}))
        s.add(AnomalyRow(run_id=run_id, attempt_id=a2, seq=1, step=65, kind="grad_norm_spike",
                         detector="grad_norm_spike", value=7.0, threshold=6.0, action="record"))
        s.add_all([
            CheckpointRow(run_id=run_id, attempt_id=a1, step=40, uri="file:///c/a1/40", sha256="a" * 64,
                          healthy=True, verdict={"weights_finite": True}),
            CheckpointRow(run_id=run_id, attempt_id=a1, step=20, uri="file:///c/a1/20", sha256="b" * 64,
                          healthy=True, deleted=True),
            CheckpointRow(run_id=run_id, attempt_id=a2, step=60, uri="file:///c/a2/60", sha256="c" * 64,
                          healthy=False, verdict={"anomalies_since_previous": 1}),
        ])
        s.commit()
    return {"run": run_id, "a1": a1, "a2": a2}


def test_attempts_in_order(client: TestClient, run_with_history: dict[str, int]) -> None:
    r = client.get(f"{RUNS}/{run_with_history['run']}/attempts")
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == 2 and body["next"] is None
    assert [(a["number"], a["state"], a["kind"]) for a in body["data"]] == [
        (1, "diverged", "initial"), (2, "running", "numeric_retry")
    ]
    assert body["data"][1]["overrides"] == {"optimizer.lr": [0.003, 0.0015]}
    one = client.get(f"{RUNS}/{run_with_history['run']}/attempts/2")
    assert one.status_code == 200 and one.json() == body["data"][1]
    missing = client.get(f"{RUNS}/{run_with_history['run']}/attempts/3")
    assert missing.status_code == 404
    assert missing.json()["detail"] == f"run {run_with_history['run']} has no attempt 3"


def test_anomalies_filters(client: TestClient, run_with_history: dict[str, int]) -> None:
    url = f"{RUNS}/{run_with_history['run']}/anomalies"

    def steps(**params: object) -> list[int]:
        r = client.get(url, params=params)
        assert r.status_code == 200, r.text
        assert r.json()["count"] == len(r.json()["data"])
        return [a["step"] for a in r.json()["data"]]

    assert steps() == [58, 59, 60, 61, 62, 65]
    assert steps(kind="grad_norm_spike") == [58, 60, 62, 65]
    assert steps(attempt=2) == [65]
    assert steps(attempt=1, kind="grad_norm_spike") == [58, 60, 62]
    assert steps(step_min=60, step_max=62) == [60, 61, 62]
    bogus = client.get(url, params={"kind": "nothing"})  # an unknown kind is refused, not an empty page
    assert bogus.status_code == 422 and bogus.headers["content-type"] == "application/problem+json"
    assert "kind" in bogus.text and "grad_norm_spike" in bogus.text
    first = client.get(url).json()["data"][0]
    assert first["attempt"] == 1 and first["attempt_id"] == run_with_history["a1"]
    assert first["details"] == {"z": 9.5} and first["action"] == "rollback"
    nonfinite = client.get(url, params={"kind": "nonfinite"}).json()["data"][0]
    assert nonfinite["value"] == "Infinity"  # not null: a reader must see that the value was infinite


def test_anomalies_cursor_pages_through_everything_once(client: TestClient, run_with_history: dict[str, int]) -> None:
    url = f"{RUNS}/{run_with_history['run']}/anomalies"
    seen: list[int] = []
    cursor = None
    while True:
        params: dict[str, object] = {"limit": 4}
        if cursor:
            params["cursor"] = cursor
        body = client.get(url, params=params).json()
        assert body["count"] == 6
        seen += [a["id"] for a in body["data"]]
        cursor = body["next"]
        if cursor is None:
            break
    all_ids = [a["id"] for a in client.get(url, params={"limit": 100}).json()["data"]]
    assert seen == all_ids and len(set(seen)) == 6


def test_checkpoints_by_step(client: TestClient, run_with_history: dict[str, int]) -> None:
    r = client.get(f"{RUNS}/{run_with_history['run']}/checkpoints")
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == 3
    assert [(c["step"], c["attempt"], c["healthy"], c["deleted"]) for c in body["data"]] == [
        (20, 1, True, True), (40, 1, True, False), (60, 2, False, False)
    ]
    assert body["data"][1]["verdict"] == {"weights_finite": True}
    assert body["data"][1]["uri"] == "file:///c/a1/40"


def test_metrics_full_series(client: TestClient, run_with_history: dict[str, int]) -> None:
    r = client.get(f"{RUNS}/{run_with_history['run']}/metrics", params={"series": ["loss", "lr"]})
    assert r.status_code == 200
    body = r.json()
    assert body["max_points"] == 1000
    loss, lr = body["series"]
    assert (loss["name"], lr["name"]) == ("loss", "lr")
    assert loss["total_points"] == 130 and loss["downsampled"] is False
    assert loss["steps"][:2] == [0, 1] and loss["attempts"][:2] == [1, 1]
    assert loss["steps"][100:102] == [40, 41] and loss["attempts"][100:102] == [2, 2]  # attempt 2 after attempt 1
    assert lr["values"][0] == 0.003 and lr["values"][-1] == 0.0015
    assert [s["name"] for s in client.get(f"{RUNS}/{run_with_history['run']}/metrics").json()["series"]] == [
        "loss", "grad_norm", "grad_norm_clipped", "lr", "loss_scale", "throughput", "eval_loss", "skipped"
    ]


def test_metrics_skipped_series_holds_only_the_skipped_steps(client: TestClient,
                                                             run_with_history: dict[str, int]) -> None:
    r = client.get(f"{RUNS}/{run_with_history['run']}/metrics", params={"series": ["skipped", "loss"]})
    assert r.status_code == 200
    skipped, loss = r.json()["series"]
    assert (skipped["steps"], skipped["attempts"], skipped["values"], skipped["total_points"]) == ([60], [1], [1], 1)
    assert 60 in loss["steps"][:100]  # the skipped step keeps its loss point: the batch's loss, flagged here
    none = client.get(f"{RUNS}/{run_with_history['run']}/metrics", params={"series": ["skipped"], "attempt": 2})
    assert none.json()["series"][0]["steps"] == []


def test_metrics_eval_loss_series_per_attempt_with_filters(
    client: TestClient, run_with_history: dict[str, int], session_factory: sessionmaker[Session]
) -> None:
    ids = run_with_history
    with session_factory() as s:
        for step, value in ((0, 3.2), (20, 3.0), (40, 2.8), (60, 2.6)):
            s.add(EvalPoint(run_id=ids["run"], attempt_id=ids["a1"], step=step, eval_loss=value))
        s.add(EvalPoint(run_id=ids["run"], attempt_id=ids["a1"], step=61, eval_loss=None))  # not finite
        s.add(EvalPoint(run_id=ids["run"], attempt_id=ids["a2"], step=60, eval_loss=2.5))
        s.commit()
    url = f"{RUNS}/{ids['run']}/metrics"
    r = client.get(url, params={"series": ["eval_loss", "loss"]})
    assert r.status_code == 200
    ev, loss = r.json()["series"]
    assert ev == {"name": "eval_loss", "steps": [0, 20, 40, 60, 60], "values": [3.2, 3.0, 2.8, 2.6, 2.5],
                  "attempts": [1, 1, 1, 1, 2], "total_points": 5, "downsampled": False}
    assert loss["total_points"] == 130
    (only,) = client.get(url, params={"series": "eval_loss", "attempt": 1, "step_min": 10, "step_max": 50}).json()[
        "series"]
    assert (only["steps"], only["attempts"]) == ([20, 40], [1, 1])
    (small,) = client.get(url, params={"series": "eval_loss", "max_points": 2}).json()["series"]
    assert small["downsampled"] is True and small["values"] == [3.2, 2.5]


def test_metrics_downsampling_keeps_the_spike(client: TestClient, run_with_history: dict[str, int]) -> None:
    r = client.get(f"{RUNS}/{run_with_history['run']}/metrics",
                   params={"series": "grad_norm", "attempt": 1, "max_points": 10})
    assert r.status_code == 200
    (gn,) = r.json()["series"]
    assert gn["total_points"] == 100 and gn["downsampled"] is True
    assert len(gn["values"]) <= 10
    assert max(gn["values"]) == 500.0
    assert gn["steps"][gn["values"].index(500.0)] == 60
    assert gn["steps"] == sorted(gn["steps"])  # still in step order within the attempt


def test_metrics_step_range_and_empty_series(client: TestClient, run_with_history: dict[str, int]) -> None:
    url = f"{RUNS}/{run_with_history['run']}/metrics"
    body = client.get(url, params={"series": ["loss", "loss_scale"], "step_min": 45, "step_max": 46}).json()
    loss, scale = body["series"]
    assert loss["steps"] == [45, 46, 45, 46] and loss["attempts"] == [1, 1, 2, 2]
    assert scale == {"name": "loss_scale", "steps": [], "values": [], "attempts": [], "total_points": 0,
                     "downsampled": False}


@pytest.mark.parametrize(
    "params, path",
    [({"series": "nope"}, "query.series.0"), ({"max_points": 1}, "query.max_points"),
     ({"step_min": 9, "step_max": 3}, "query.step_min")],
)
def test_metrics_bad_parameters(
    client: TestClient, run_with_history: dict[str, int], params: dict[str, object], path: str
) -> None:
    r = client.get(f"{RUNS}/{run_with_history['run']}/metrics", params=params)
    assert r.status_code == 422
    assert r.json()["errors"][0]["path"] == path
