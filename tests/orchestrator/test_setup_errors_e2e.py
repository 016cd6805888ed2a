"""Setup errors and user code end to end: the real scheduler on the session's Ray, a SQLite store.

Each bad recipe ends its run FAILED with failure kind ``config_error``, no crashed attempt and no crash restart, the
message naming the field: a factory module nobody can import, a model factory that returns no ``nn.Module``, a
forward that returns per-sample losses (all three caught by the preflight probe, before any ``TorchTrainer``
exists), the same contract violation with the probe off (caught by the workers' setup and classified there), and
an oversized seed in a stored recipe (caught at the claim). The user's package lives in a temp directory that is
not on this process's ``sys.path``: it reaches the workers only through the recipe's ``code`` section (Ray's
``runtime_env``), and a run that trains its model succeeds. Nothing here asserts on time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.orm import Session, sessionmaker

import migrations
from contracts.recipe import validate_recipe_data
from orchestrator.scheduler import Scheduler
from orchestrator.settings import Settings
from orchestrator.store.db import make_engine, make_session_factory, transaction
from orchestrator.store.models import Attempt, RecipeRow, Run
from orchestrator.store.repo import create_run
from tests.orchestrator.userpkg import PACKAGE, custom_sections, write_package

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]
DEADLINE_S = 420.0  # generous: the machine is shared; nothing here asserts on time

RECIPE: dict[str, Any] = {
    "name": "user-code",
    "training": {"max_steps": 12, "batch_size": 8, "seed": 1},
    "optimizer": {"name": "adamw", "lr": 0.01},
    "schedule": {"warmup_steps": 2, "decay": "constant"},
    "checkpoint": {"every_steps": 6, "keep": 2},
    "success": {"min_progress": 0.0, "early_min_progress": 0.0},
}


@pytest.fixture
def user_code(tmp_path: Path) -> Iterator[Path]:
    """The user's package, written where this process cannot import it."""
    pkg = write_package(tmp_path / "usercode")
    assert not any(str(tmp_path) in p for p in sys.path)
    yield pkg


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Settings, sessionmaker[Session]]]:
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'ballast.db'}",
                        checkpoint_root=str(tmp_path / "checkpoints"), scheduler_poll_seconds=0.3,
                        max_concurrent_runs=2, allowed_import_modules=[PACKAGE, "nowhere_pkg"])
    migrations.upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    yield settings, make_session_factory(engine)
    engine.dispose()


def submit(factory: sessionmaker[Session], settings: Settings, doc: dict[str, Any]) -> int:
    recipe = validate_recipe_data(doc, allowed_import_modules=settings.allowed_import_modules)
    with transaction(factory) as s:
        run, _ = create_run(session=s, owner="tester", recipe=recipe, text=yaml.safe_dump(doc))
        return run.id


def drive(scheduler: Scheduler, factory: sessionmaker[Session], run_id: int) -> Run:
    stop_at = time.monotonic() + DEADLINE_S
    while time.monotonic() < stop_at:
        scheduler.tick()
        with transaction(factory) as s:
            run = s.get(Run, run_id)
            assert run is not None
            if run.state in ("succeeded", "failed", "cancelled"):
                return run
        time.sleep(0.3)
    raise AssertionError(f"run {run_id} did not end")


def attempts_of(factory: sessionmaker[Session], run_id: int) -> list[Attempt]:
    with transaction(factory) as s:
        return list(s.scalars(sa.select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)))


def assert_config_error(factory: sessionmaker[Session], run: Run, field: str, says: str, stage: str) -> Attempt:
    assert (run.state, run.failure_kind) == ("failed", "config_error"), run.reason
    assert (run.crash_restarts_used, run.retries_used) == (0, 0)
    assert run.reason is not None and f"cannot run as configured: {field}:" in run.reason and says in run.reason
    (only,) = attempts_of(factory, run.id)
    assert only.state == "config_error"
    assert only.outcome is not None and only.outcome["stage"] == stage
    return only


BAD_RECIPES = [
    pytest.param({"model": {"name": "custom", "factory": "nowhere_pkg.models:make"},
                  "data": custom_sections()["data"]}, "model.factory", "cannot import module",
                 id="missing-module"),
    pytest.param(custom_sections("make_not_a_module"), "model.factory", "must return a torch.nn.Module",
                 id="not-a-module"),
    pytest.param(custom_sections("make_per_sample_loss"), "loss.name", "not a scalar; add a loss: section",
                 id="non-scalar-loss"),
]


@pytest.mark.parametrize(("sections", "field", "says"), BAD_RECIPES)
def test_the_preflight_fails_a_recipe_that_cannot_run_before_any_trainer_starts(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]], user_code: Path,
    sections: dict[str, Any], field: str, says: str,
) -> None:
    settings, factory = store
    run_id = submit(factory, settings, {**RECIPE, **sections, "code": {"py_modules": [str(user_code)]}})
    run = drive(Scheduler(settings, factory), factory, run_id)

    only = assert_config_error(factory, run, field, says, stage="preflight")
    assert only.ray_info["preflight"]["status"] == "config_error"
    assert only.started_at is None  # never running: no worker reported anything
    # no TorchTrainer was built: Ray Train never created the attempt's run directory
    assert not (Path(settings.checkpoint_root) / f"run-{run_id}-attempt-1").exists()


def test_a_setup_error_the_probe_did_not_see_is_classified_on_the_workers(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]], user_code: Path
) -> None:
    settings, factory = store
    settings = settings.model_copy(update={"preflight_timeout_seconds": 0.0})  # the probe off
    run_id = submit(factory, settings, {**RECIPE, **custom_sections("make_not_a_module"),
                                        "code": {"working_dir": str(user_code.parent)}})
    run = drive(Scheduler(settings, factory), factory, run_id)
    only = assert_config_error(factory, run, "model.factory", "must return a torch.nn.Module", stage="setup")
    assert "preflight" not in only.ray_info


def test_an_oversized_seed_in_a_stored_recipe_fails_at_the_claim(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]]
) -> None:
    """The API refuses it at submit (tests/api/test_setup_errors_api.py); a recipe stored before that rule, or
    written to the store by hand, still ends as a config error, without a worker group."""
    settings, factory = store
    run_id = submit(factory, settings, RECIPE)
    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        row = s.get(RecipeRow, run.recipe_id)
        assert row is not None
        row.parsed = {**row.parsed, "training": {**row.parsed["training"], "seed": 10**30}}
    run = drive(Scheduler(settings, factory), factory, run_id)
    assert (run.state, run.failure_kind, run.crash_restarts_used) == ("failed", "config_error", 0)
    assert run.reason is not None and "training.seed" in run.reason
    assert attempts_of(factory, run_id) == []


def test_a_users_package_shipped_in_code_trains_on_the_workers(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]], user_code: Path
) -> None:
    settings, factory = store
    with pytest.raises(ImportError):
        __import__(PACKAGE)  # not importable here: only the workers get it, through the runtime_env
    run_id = submit(factory, settings, {**RECIPE, **custom_sections(), "code": {"py_modules": [str(user_code)]}})
    run = drive(Scheduler(settings, factory), factory, run_id)

    assert (run.state, run.failure_kind) == ("succeeded", None), run.reason
    (only,) = attempts_of(factory, run_id)
    assert only.state == "succeeded" and only.last_step == RECIPE["training"]["max_steps"]
    assert only.ray_info["preflight"]["status"] == "ok"
