"""A run that can never fit the cluster, through the real scheduler on the session's Ray (2 CPUs) and shown by
`ballast runs show`: the reason names what it needs and what the cluster has, at once (one tick)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from sqlalchemy.orm import Session, sessionmaker

from api.client import BallastClient
from orchestrator.scheduler import Scheduler
from orchestrator.settings import Settings
from tests.api.test_cli import ballast
from tests.recipes import recipe_doc

pytestmark = [pytest.mark.ray]


def test_runs_show_says_that_a_run_needs_more_than_the_whole_cluster(
    ray_cluster: Any, db_url: str, session_factory: sessionmaker[Session], tmp_path: Path,
    make_server: Callable[..., str],
) -> None:
    url = make_server()
    doc = recipe_doc({"name": "too-big"}, resources={"num_workers": 4096})
    with BallastClient(url) as client:
        run_id = int(client.submit_run(yaml.safe_dump(doc)).run["id"])
    settings = Settings(home=tmp_path, database_url=db_url, checkpoint_root=str(tmp_path / "ckpt"))
    Scheduler(settings, session_factory).tick()

    res = ballast("runs", "show", str(run_id), "--url", url)
    assert res.exit_code == 0, res.output
    shown = " ".join(res.stdout.split())  # the table wraps long reasons
    assert shown.startswith(f"run {run_id} too-big FAILED"), res.stdout
    assert ("reason cannot run on this cluster: needs 4096 CPUs; the cluster has 2 (resources.num_workers 4096 x "
            "cpus_per_worker 1)") in shown, res.stdout
