"""`ballast train --workers N`: a local Ray Train run whose events come back through the channel actor, driven by
the scheduler's launcher (launch, acknowledged polls, kill), so each event reaches the progress sink once."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import api.cli  # noqa: F401  (registers the commands)
from api.cli.app import app

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]


def test_train_with_two_workers_sees_every_step_once_and_leaves_no_actor(ray_cluster: Any, tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["train", str(REPO / "recipes" / "baseline.yaml"), "--steps", "60", "--workers",
                                   "2", "--checkpoint-dir", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["outcome"] == "succeeded" and out["final_step"] == 60
    assert len(out["losses"]) == 60  # one metric per step, none delivered twice
    assert [(c["step"], c["healthy"]) for c in out["checkpoints"]] == [(50, True), (60, True)]
    named = ray_cluster.util.list_named_actors(all_namespaces=True)
    assert not [a for a in named if a["name"].startswith("ballast-train-")]


def test_train_with_two_workers_also_recovers(ray_cluster: Any, tmp_path: Path) -> None:
    """The same recovery loop as in-process (``api/cli/local_run.py``), each attempt a Ray Train run."""
    from tests.api.test_train_loop import FAULT_STEP, spiky, write

    res = CliRunner().invoke(app, ["train", str(write(tmp_path, spiky())), "--workers", "2", "--checkpoint-dir",
                                   str(tmp_path / "ckpt"), "--json"])
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    first, second = out["attempts"][:2]
    assert first["outcome"] == "diverged" and first["onset_step"] >= FAULT_STEP
    parent = second["resumed_from"]
    assert parent["healthy"] and parent["step"] <= first["onset_step"] and second["overrides"]
    assert parent["uri"].startswith(str((tmp_path / "ckpt").resolve() / "attempt-1"))
    assert out["outcome"] == "succeeded" and out["final_step"] == 60
    assert len(out["losses"]) == 60 - parent["step"]  # attempt 2's steps, each delivered once
    named = ray_cluster.util.list_named_actors(all_namespaces=True)
    assert not [a for a in named if a["name"].startswith("ballast-train-")]
