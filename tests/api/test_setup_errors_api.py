"""What the API refuses at submit without user code (a seed out of range, a factory off the allow-list, ``code.pip``
unless the server allows it) and what it accepts for the preflight to judge (an allowed module the server cannot
import, code paths it cannot see); and how a run that failed on a config error reads. Both backends."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.store.models import Run
from tests.api.conftest import YAML_RECIPE, post_yaml, seed_attempt, seed_run

RUNS = "/api/v1/runs"
JSON_RECIPE: dict[str, Any] = {"name": "demo", "training": {"max_steps": 100}}


def _count(factory: sessionmaker[Session]) -> int:
    with factory() as s:
        return int(s.scalar(sa.select(sa.func.count()).select_from(Run)) or 0)


def _refused(r: Any, path: str) -> str:
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    errors = r.json()["errors"]
    assert [e["path"] for e in errors] == [path]
    return str(errors[0]["message"])


def post_json(client: TestClient, doc: Any, path: str = RUNS) -> Any:
    return client.post(path, content=json.dumps(doc), headers={"content-type": "application/json"})


@pytest.mark.parametrize("endpoint", [RUNS, "/api/v1/recipes:validate"])
def test_an_oversized_seed_is_422_naming_it_in_yaml_and_json(
    client: TestClient, session_factory: sessionmaker[Session], endpoint: str
) -> None:
    text = YAML_RECIPE.replace("max_steps: 100", "max_steps: 100\n  seed: 1000000000000000000000000000000")
    assert "64 bits" in _refused(post_yaml(client, text, path=endpoint), "training.seed")
    doc = {**JSON_RECIPE, "training": {"max_steps": 100, "seed": 10**30}}
    assert "64 bits" in _refused(post_json(client, doc, endpoint), "training.seed")
    assert _count(session_factory) == 0


def test_a_seed_the_engine_cannot_derive_rank_seeds_from_is_422(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    """Within 64 bits, but ``seed * 1009 + rank`` would overflow torch's generator on the workers."""
    doc = {**JSON_RECIPE, "training": {"max_steps": 100, "seed": 2**62}}
    assert "less than or equal to" in _refused(post_json(client, doc), "training.seed")
    assert _count(session_factory) == 0


def test_a_factory_off_the_allow_list_is_refused_at_submit(
    make_client: Callable[..., TestClient], session_factory: sessionmaker[Session]
) -> None:
    client = make_client(allowed_import_modules=["mylab"])
    doc = {**JSON_RECIPE, "model": {"name": "custom", "factory": "otherlab.models:make"}}
    assert "allow-list" in _refused(post_json(client, doc), "model.factory")
    assert _count(session_factory) == 0


def test_an_allowed_module_the_server_cannot_import_is_accepted_for_the_preflight(
    make_client: Callable[..., TestClient], session_factory: sessionmaker[Session]
) -> None:
    """User code may exist only on the workers: importing it is the preflight's job, not the API's."""
    client = make_client(allowed_import_modules=["mylab_only_on_workers"])
    doc = {**JSON_RECIPE, "model": {"name": "custom", "factory": "mylab_only_on_workers.models:make"},
           "code": {"py_modules": ["/srv/code/mylab_only_on_workers"], "working_dir": "s3://bucket/code.zip"}}
    r = post_json(client, doc)
    assert r.status_code == 201, r.text
    assert _count(session_factory) == 1


def test_code_pip_is_refused_unless_the_server_allows_it(
    make_client: Callable[..., TestClient], session_factory: sessionmaker[Session]
) -> None:
    doc = {**JSON_RECIPE, "code": {"pip": ["einops==0.8.0"]}}
    assert "BALLAST_ALLOW_RUNTIME_PIP" in _refused(post_json(make_client(), doc), "code.pip")
    assert "BALLAST_ALLOW_RUNTIME_PIP" in _refused(
        post_json(make_client(), doc, "/api/v1/recipes:validate"), "code.pip")
    assert _count(session_factory) == 0
    assert post_json(make_client(allow_runtime_pip=True), doc).status_code == 201


def test_a_relative_code_path_is_422(client: TestClient) -> None:
    doc = {**JSON_RECIPE, "code": {"py_modules": ["src/mylab"]}}
    assert "absolute path" in _refused(post_json(client, doc), "code.py_modules.0")


def test_a_run_failed_on_a_config_error_shows_its_kind_and_the_field(
    client: TestClient, session_factory: sessionmaker[Session]
) -> None:
    run_id = seed_run(session_factory, state="failed")
    seed_attempt(session_factory, run_id, 1, state="config_error")
    reason = "attempt 1 cannot run as configured: model.factory: must return a torch.nn.Module, got dict"
    with session_factory() as s:
        run = s.get(Run, run_id)
        assert run is not None
        run.reason, run.failure_kind = reason, "config_error"
        s.commit()
    body = client.get(f"{RUNS}/{run_id}").json()
    assert (body["state"], body["failure_kind"], body["reason"]) == ("failed", "config_error", reason)
    assert body["attempt"]["state"] == "config_error"
    assert body["summary"]["crash_restarts_used"] == 0
    listed = client.get(RUNS, params={"state": "failed"}).json()["data"]
    assert [(r["id"], r["failure_kind"]) for r in listed] == [(run_id, "config_error")]
    assert client.get(f"{RUNS}/{run_id}/attempts").json()["data"][0]["state"] == "config_error"


def test_other_runs_have_no_failure_kind(client: TestClient) -> None:
    body = post_yaml(client).json()
    assert body["failure_kind"] is None


def test_the_cli_says_a_run_failed_on_a_config_error() -> None:
    from api.cli.watch import _closing_line

    run = {"id": 7, "state": "failed", "failure_kind": "config_error", "current_attempt": 1,
           "reason": "attempt 1 cannot run as configured: model.factory: cannot import module 'mylab'",
           "summary": {"retries_used": 0}}
    assert _closing_line(run) == ("run 7 FAILED [config_error] (1 attempt, 0 retries): attempt 1 cannot run as "
                                  "configured: model.factory: cannot import module 'mylab'")
    assert _closing_line({**run, "failure_kind": None}).startswith("run 7 FAILED (1 attempt")
