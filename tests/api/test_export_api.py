"""``GET /runs/{id}/export`` over real HTTP (uvicorn): the dashboard's export button and ``Client.download_model``.

The run is the one ``test_export.py`` trains (a tiny GPT, checkpoints at steps 20 and 40, ingested as the
scheduler would); the file the server sends loads with ``strict=True`` into a fresh model, equal to the checkpoint.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from io import BytesIO
from pathlib import Path

import httpx
import torch
from safetensors.torch import load as load_safetensors

from ballast import Client
from tests.api.test_export import (  # noqa: F401  (fixtures)
    Trained,
    assert_equal_weights,
    fresh,
    saved_weights,
    served,
    trained,
)


def test_export_streams_the_latest_healthy_checkpoint_as_safetensors(
    url: str, served: Callable[..., int], trained: Trained  # noqa: F811
) -> None:
    run_id = served()
    r = httpx.get(f"{url}/api/v1/runs/{run_id}/export", timeout=120)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/octet-stream"
    assert r.headers["content-disposition"] == f'attachment; filename="tiny-run{run_id}-step40.safetensors"'
    assert r.headers["x-ballast-step"] == "40"
    assert r.headers["x-ballast-sha256"] == hashlib.sha256(r.content).hexdigest()
    model = fresh(trained.recipe)
    model.load_state_dict(load_safetensors(r.content), strict=True)
    assert_equal_weights(model, saved_weights(trained.checkpoint(40)))


def test_export_by_step_or_id_as_a_state_dict_and_through_the_sdk(
    url: str, served: Callable[..., int], trained: Trained, tmp_path: Path  # noqa: F811
) -> None:
    run_id = served()
    with Client(url) as client:
        first = next(c for c in client.checkpoints(run_id) if c["step"] == 20)
        path = client.download_model(run_id, tmp_path, format="state_dict", checkpoint=first["id"])
    assert path == tmp_path / f"tiny-run{run_id}-step20.pt"
    model = fresh(trained.recipe)
    model.load_state_dict(torch.load(path, weights_only=True), strict=True)
    assert_equal_weights(model, saved_weights(trained.checkpoint(20)))
    r = httpx.get(f"{url}/api/v1/runs/{run_id}/export", params={"step": 20, "format": "state_dict"}, timeout=120)
    assert r.status_code == 200 and r.headers["x-ballast-checkpoint"] == str(first["id"])
    assert torch.load(BytesIO(r.content), weights_only=True).keys() == model.state_dict().keys()


def _problem(r: httpx.Response, status: int) -> dict[str, object]:
    assert r.status_code == status, r.text
    assert r.headers["content-type"] == "application/problem+json"
    body: dict[str, object] = r.json()
    return body


def test_bad_input_is_a_problem_naming_the_field(url: str, served: Callable[..., int]) -> None:  # noqa: F811
    run_id = served()
    base = f"{url}/api/v1/runs/{run_id}/export"
    body = _problem(httpx.get(base, params={"step": 15}), 422)
    assert body["errors"] == [{"path": "query.step",
                               "message": "step 15: the run has no checkpoint there (it has steps [20, 40])"}]
    body = _problem(httpx.get(base, params={"checkpoint": 999}), 422)
    assert body["errors"] == [{"path": "query.checkpoint", "message": "checkpoint 999: not a checkpoint of this run"}]
    body = _problem(httpx.get(base, params={"checkpoint": 1, "step": 20}), 422)
    assert body["errors"] == [{"path": "query.step", "message": "pass checkpoint or step, not both"}]
    body = _problem(httpx.get(base, params={"format": "hf"}), 422)
    assert [e["path"] for e in body["errors"]] == ["query.format"]  # type: ignore[attr-defined,union-attr]
    _problem(httpx.get(f"{url}/api/v1/runs/999999/export"), 404)


def test_a_run_without_a_healthy_checkpoint_or_with_missing_files_is_a_409(
    url: str, served: Callable[..., int], trained: Trained, tmp_path: Path  # noqa: F811
) -> None:
    unhealthy = [{**e, "data": {**e["data"], "healthy": False}} if e["type"] == "checkpoint" else e
                 for e in trained.events]
    body = _problem(httpx.get(f"{url}/api/v1/runs/{served(unhealthy)}/export"), 409)
    assert body["type"] == "urn:ballast:problem:no-healthy-checkpoint"
    gone = [{**e, "data": {**e["data"], "uri": str(tmp_path / "gone")}} if e["type"] == "checkpoint" else e
            for e in trained.events]
    body = _problem(httpx.get(f"{url}/api/v1/runs/{served(gone)}/export"), 409)
    assert body["type"] == "urn:ballast:problem:export-failed" and "no such checkpoint directory" in str(
        body["detail"])


def test_someone_elses_run_is_404(
    make_server: Callable[..., str], make_token: Callable[..., dict[str, str]], served: Callable[..., int],  # noqa: F811
) -> None:
    run_id = served()  # owned by `local` (auth off)
    base = make_server(auth=True)
    assert httpx.get(f"{base}/api/v1/runs/{run_id}/export").status_code == 401
    assert httpx.get(f"{base}/api/v1/runs/{run_id}/export", headers=make_token("bob", "read")).status_code == 404
