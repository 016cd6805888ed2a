"""``from ballast import Client``: the SDK against the real app over real HTTP (uvicorn in a thread), on both
database backends. The tests play the scheduler's part by writing to the store, as the CLI tests do."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from sqlalchemy.orm import Session, sessionmaker

import ballast
from api.client import BallastClient
from ballast import ApiError, Client, Unreachable, WaitTimeout
from orchestrator.policy.states import RunState
from orchestrator.store.models import Run
from tests.api.conftest import YAML_RECIPE, seed_attempt
from tests.ports import free_port


def set_state(factory: sessionmaker[Session], run_id: int, state: RunState) -> None:
    with factory() as session:
        run = session.get(Run, run_id)
        assert run is not None
        run.state = state.value
        session.commit()


def test_the_public_name_is_the_one_client_the_cli_uses() -> None:
    from api.cli import options

    assert ballast.Client is Client is BallastClient
    assert options.Client is Client
    assert set(ballast.__all__) >= {"Client", "ApiError", "Unreachable", "WaitTimeout"}


def test_importing_the_sdk_pulls_in_no_torch_ray_or_server() -> None:
    code = ("import ballast, sys, json; print(json.dumps(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'torch', 'ray', 'sqlalchemy', 'fastapi', 'workers', 'orchestrator'})))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert json.loads(out.stdout) == []


def test_submit_takes_text_a_path_or_a_document(url: str, tmp_path: Path) -> None:  # noqa: F811
    path = tmp_path / "demo.yaml"
    path.write_text(YAML_RECIPE)
    doc = yaml.safe_load(YAML_RECIPE)
    with Client(url) as client:
        runs = [client.submit(YAML_RECIPE), client.submit(path), client.submit({**doc, "name": "as-dict"})]
        assert [r["id"] for r in runs] == [1, 2, 3]
        assert [r["state"] for r in runs] == ["queued"] * 3
        assert [r["name"] for r in runs] == ["demo", "demo", "as-dict"]
        # the same recipe, however it was sent, is the same normalised document
        assert runs[0]["content_hash"] == runs[1]["content_hash"]

        again = client.submit(YAML_RECIPE, idempotency_key="k-1")
        assert client.submit(YAML_RECIPE, idempotency_key="k-1")["id"] == again["id"]

        with pytest.raises(ApiError) as err:
            client.submit({"name": "bad", "optimizer": {"lr": -1}})
        assert err.value.status == 422
        assert any(e["path"] == "optimizer.lr" for e in err.value.field_errors)


def test_runs_get_and_the_run_children(url: str, session_factory: sessionmaker[Session]) -> None:  # noqa: F811
    with Client(url) as client:
        ids = [client.submit(YAML_RECIPE.replace("name: demo", f"name: r{i}"))["id"] for i in range(3)]
        assert [r["id"] for r in client.runs()] == ids[::-1]  # newest first, every page followed
        assert [r["id"] for r in client.runs(limit=2)] == ids[:0:-1]
        assert [r["name"] for r in client.runs(name="r1")] == ["r1"]

        run = client.get(ids[0])
        assert run["id"] == ids[0] and run["recipe"]["optimizer"]["lr"] == 0.003
        assert client.get_run(ids[0])["id"] == ids[0]

        seed_attempt(session_factory, ids[0], 1)
        set_state(session_factory, ids[0], RunState.running)
        attempts = client.attempts(ids[0])
        assert [(a["number"], a["state"], a["kind"]) for a in attempts] == [(1, "running", "initial")]
        assert client.checkpoints(ids[0]) == []
        assert client.anomalies(ids[0])["data"] == [] and client.all_anomalies(ids[0]) == []
        series = client.metrics(ids[0], series=["loss", "lr"])["series"]
        assert [s["name"] for s in series] == ["loss", "lr"] and all(s["steps"] == [] for s in series)

        with pytest.raises(ApiError) as err:
            client.get(999)
        assert err.value.status == 404


def test_cancel_retry_and_wait(url: str, session_factory: sessionmaker[Session]) -> None:  # noqa: F811
    with Client(url) as client:
        run_id = client.submit(YAML_RECIPE)["id"]
        with pytest.raises(WaitTimeout) as timed_out:
            client.wait(run_id, timeout=0.3, poll=0.05)
        assert timed_out.value.run["state"] == "queued" and isinstance(timed_out.value, TimeoutError)

        assert client.cancel(run_id)["state"] == "cancelled"  # a queued run is cancelled at once
        assert client.wait(run_id, timeout=5)["state"] == "cancelled"

        retried = client.retry(run_id, overrides={"optimizer.lr": 1e-4})
        assert retried["run"]["state"] == "queued" and retried["attempt"]["kind"] == "manual"
        assert retried["attempt"]["overrides"] == {"optimizer.lr": [0.003, 0.0001]}
        with pytest.raises(ApiError) as err:
            client.retry(run_id)  # queued again: nothing to retry
        assert err.value.status == 409

        set_state(session_factory, run_id, RunState.succeeded)
        done = client.wait(run_id, timeout=5, poll=0.05)
        assert done["state"] == "succeeded" and done["id"] == run_id


def test_nothing_listening_is_one_clear_error() -> None:
    with Client(f"http://127.0.0.1:{free_port()}") as client, pytest.raises(Unreachable) as err:
        client.runs()
    assert "is `ballast serve` running?" in str(err.value)
