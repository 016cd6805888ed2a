"""GET /api/v1/runs/{id}/events: the SSE stream of state changes, anomalies and metrics."""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

import api.routes.events as events_module
from orchestrator.policy.states import AttemptState, RunState
from orchestrator.store import repo
from orchestrator.store.models import AnomalyRow, Attempt, EvalPoint, MetricPoint, Run
from tests.api.conftest import post_yaml

RUNS = "/api/v1/runs"


def parse_sse(text: str) -> list[dict[str, Any]]:
    out = []
    for block in text.split("\n\n"):
        fields: dict[str, Any] = {}
        for line in block.splitlines():
            if line.startswith(":"):
                continue
            key, _, value = line.partition(": ")
            fields[key] = value
        if "event" in fields:
            fields["data"] = json.loads(fields["data"])
            out.append(fields)
    return out


def _advance(factory: sessionmaker[Session], run_id: int, *states: RunState) -> None:
    with factory() as s:
        run = s.get(Run, run_id)
        assert run is not None
        for st in states:
            repo.set_run_state(session=s, run=run, to=st, reason=f"to {st.value}")
        s.commit()


def _start_attempt(factory: sessionmaker[Session], run_id: int) -> int:
    with factory() as s:
        att = Attempt(run_id=run_id, number=1, state=AttemptState.pending.value)
        s.add(att)
        s.flush()
        repo.set_attempt_state(session=s, attempt=att, to=AttemptState.running)
        s.commit()
        return att.id


def test_stream_of_a_finished_run_replays_everything_and_ends(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = post_yaml(client).json()["id"]
    _advance(session_factory, run_id, RunState.starting, RunState.running)
    att = _start_attempt(session_factory, run_id)
    with session_factory() as s:
        s.add(AnomalyRow(run_id=run_id, attempt_id=att, seq=1, step=7, kind="loss_spike", detector="loss_spike",
                         value=9.0, threshold=4.0, action="record"))
        for step in range(3):
            s.add(MetricPoint(run_id=run_id, attempt_id=att, step=step, loss=2.0 - step, grad_norm=1.0, lr=0.003))
        s.add_all([EvalPoint(run_id=run_id, attempt_id=att, step=0, eval_loss=2.5),
                   EvalPoint(run_id=run_id, attempt_id=att, step=2, eval_loss=None)])
        s.commit()
    _advance(session_factory, run_id, RunState.succeeded)
    r = client.get(f"{RUNS}/{run_id}/events")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    msgs = parse_sse(r.text)
    kinds = [m["event"] for m in msgs]
    assert kinds == ["run", "state", "state", "state", "state", "state", "anomaly", "eval", "eval", "metric", "end"]
    states = [(m["data"]["entity"], m["data"]["from_state"], m["data"]["to_state"])
              for m in msgs if m["event"] == "state"]
    assert states == [("run", None, "queued"), ("run", "queued", "starting"), ("run", "starting", "running"),
                      ("attempt", "pending", "running"), ("run", "running", "succeeded")]
    assert msgs[6]["data"]["kind"] == "loss_spike" and msgs[6]["data"]["attempt"] == 1
    # every eval point (sparse), the non-finite one as null
    assert [(m["data"]["step"], m["data"]["eval_loss"]) for m in msgs[7:9]] == [(0, 2.5), (2, None)]
    assert msgs[9]["data"]["step"] == 2 and msgs[9]["data"]["loss"] == 0.0  # only the newest metric
    # a reconnect after the first eval gets the second only; a 3-part id (before evals existed) replays them
    after_first = parse_sse(client.get(f"{RUNS}/{run_id}/events", headers={"Last-Event-ID": msgs[7]["id"]}).text)
    assert [m["data"]["step"] for m in after_first if m["event"] == "eval"] == [2]
    old_id = ".".join(msgs[6]["id"].split(".")[:3])
    legacy = parse_sse(client.get(f"{RUNS}/{run_id}/events", headers={"Last-Event-ID": old_id}).text)
    assert [m["event"] for m in legacy] == ["run", "eval", "eval", "metric", "end"]
    assert msgs[-1]["data"]["state"] == "succeeded"
    assert msgs[-1]["data"]["summary"]["anomalies_by_kind"] == {"loss_spike": 1}
    # ids are positions: they never go backwards
    positions = [tuple(int(p) for p in m["id"].split(".")) for m in msgs]
    assert positions == sorted(positions)


def test_last_event_id_resumes_after_that_position(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = post_yaml(client).json()["id"]
    _advance(session_factory, run_id, RunState.starting, RunState.running, RunState.failed)
    full = parse_sse(client.get(f"{RUNS}/{run_id}/events").text)
    second_state = [m for m in full if m["event"] == "state"][1]
    resumed = parse_sse(client.get(f"{RUNS}/{run_id}/events", headers={"Last-Event-ID": second_state["id"]}).text)
    assert [m["event"] for m in resumed] == ["run", "state", "state", "end"]
    assert [m["data"]["to_state"] for m in resumed if m["event"] == "state"] == ["running", "failed"]
    # a malformed id starts from the beginning rather than failing
    again = parse_sse(client.get(f"{RUNS}/{run_id}/events", headers={"Last-Event-ID": "garbage"}).text)
    assert [m["event"] for m in again] == [m["event"] for m in full]


def test_follow_false_sends_the_backlog_of_an_active_run_and_ends(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = post_yaml(client).json()["id"]
    msgs = parse_sse(client.get(f"{RUNS}/{run_id}/events", params={"follow": "false"}).text)
    assert [m["event"] for m in msgs] == ["run", "state"]


def test_live_stream_delivers_rows_written_after_it_started(
    client: TestClient, session_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    run_id = post_yaml(client).json()["id"]
    _advance(session_factory, run_id, RunState.starting, RunState.running)
    att = _start_attempt(session_factory, run_id)
    first_poll_done = threading.Event()
    real_poll = events_module._poll

    def poll_and_signal(*args: Any) -> Any:
        out = real_poll(*args)
        first_poll_done.set()
        return out

    monkeypatch.setattr(events_module, "_poll", poll_and_signal)

    def scheduler() -> None:
        # one transaction, as the scheduler's ingest commits: a poll sees all of it or none of it (two commits
        # could straddle a poll on a loaded machine and split the rows over two polls)
        assert first_poll_done.wait(30)
        with session_factory() as s:
            s.add(AnomalyRow(run_id=run_id, attempt_id=att, seq=1, step=3, kind="nonfinite", detector="nonfinite",
                             value=float("inf"), threshold=None, action="rollback"))
            s.add(MetricPoint(run_id=run_id, attempt_id=att, step=3, loss=float("inf"), grad_norm=2.0))
            run = s.get(Run, run_id)
            assert run is not None
            repo.set_run_state(session=s, run=run, to=RunState.failed, reason="to failed")
            s.commit()

    worker = threading.Thread(target=scheduler)
    worker.start()
    r = client.get(f"{RUNS}/{run_id}/events")
    worker.join()
    msgs = parse_sse(r.text)
    live = [m["event"] for m in msgs]
    assert live[-4:] == ["state", "anomaly", "metric", "end"]
    assert msgs[-4]["data"]["to_state"] == "failed"
    assert msgs[-3]["data"]["value"] == "Infinity"
    assert msgs[-2]["data"]["loss"] == "Infinity"
    assert msgs[-1]["data"]["state"] == "failed"
