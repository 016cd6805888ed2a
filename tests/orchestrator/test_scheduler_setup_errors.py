"""Setup errors on both backends, with the scripted launcher: a config error found by the preflight probe, by the
workers' setup or at launch fails the run at once as ``config_error`` (no crash restart, no numeric retry), with
the message naming the field; a probe that could not decide lets the attempt start; the preflight result is kept.

The fake channel reports what ``orchestrator.channel.RunChannel`` reports (``FakeChannel.preflight`` /
``setup_error``); the probe itself and the workers' classification run for real in ``test_setup_errors_e2e.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from contracts.recipe import validate_recipe_data
from orchestrator.scheduler.launching import needs_preflight
from orchestrator.store.db import transaction
from orchestrator.store.models import Event, Run
from orchestrator.store.repo import request_retry
from tests.orchestrator.fakes import FakeLauncher, attempts, load, recipe_doc, submit

MISSING = "model.factory: cannot import module 'mylab.models': ModuleNotFoundError: No module named 'mylab'"


def _run_log(factory: sessionmaker[Session], run_id: int) -> list[Event]:
    with transaction(factory) as s:
        return list(s.scalars(sa.select(Event).where(Event.run_id == run_id).order_by(Event.id)))


def _assert_failed_as_config_error(factory: sessionmaker[Session], run_id: int, field: str) -> None:
    run = load(factory, run_id)
    assert (run.state, run.failure_kind) == ("failed", "config_error")
    assert (run.crash_restarts_used, run.retries_used) == (0, 0)
    assert run.reason is not None and f"attempt 1 cannot run as configured: {field}:" in run.reason
    (only,) = attempts(factory, run_id)  # no second attempt was ever recorded
    assert only.state == "config_error"
    assert only.outcome is not None and only.outcome["error"].startswith(f"{field}:")
    assert run.claimed_by is None
    failed = [e for e in _run_log(factory, run_id) if e.entity == "run" and e.to_state == "failed"]
    assert [e.data.get("failure_kind") for e in failed] == ["config_error"]


@pytest.fixture
def make_scheduler(make_scheduler: Any) -> Any:
    """Schedulers that probe built-in recipes too (``preflight_builtin_recipes``): these tests' recipes are the
    built-in minimal one, and the channel's probe is what they script."""
    def make(scheduler_id: str = "sched-a", **kw: Any) -> Any:
        return make_scheduler(scheduler_id, **{"preflight_builtin_recipes": True, **kw})

    return make


def test_only_a_recipe_that_depends_on_outside_code_is_probed_by_default(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    (tmp_path / "pkg").mkdir()
    builtin = submit(session_factory)
    shipped = submit(session_factory, recipe_doc(code={"py_modules": [str(tmp_path / "pkg")]}))
    make_scheduler(preflight_builtin_recipes=False).tick()
    assert "preflight" not in launcher.of_run(builtin)[0].launch  # its workers classify a setup error themselves
    assert launcher.of_run(shipped)[0].launch["preflight"]["timeout_s"] > 0


@pytest.mark.parametrize(("sections", "probed"), [
    ({}, False),
    ({"model": {"name": "deep_mlp"}, "data": {"name": "regression"}}, False),
    ({"model": {"name": "custom", "factory": "mylab.models:make"}}, True),
    ({"data": {"name": "custom", "factory": "mylab.data:make"}}, True),
    ({"code": {"py_modules": ["s3://bucket/pkg.zip"]}}, True),
], ids=["tiny-gpt-markov", "mlp-regression", "custom-model", "custom-data", "shipped-code"])
def test_needs_preflight(sections: dict[str, Any], probed: bool) -> None:
    recipe = validate_recipe_data({"name": "t", **sections}, allowed_import_modules=["mylab"])
    assert needs_preflight(recipe) is probed


def test_the_first_launch_asks_for_a_preflight_and_a_retry_does_not(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory, recipe_doc(resources={"cpus_per_worker": 2}))
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    assert ch.launch["preflight"]["num_cpus"] == 1.0  # at most one CPU, and it ends before the trainer starts
    assert ch.launch["preflight"]["timeout_s"] > 0
    ch.metrics(1, range(12))
    ch.checkpoint(1, 10, tmp_path / "ckpt")
    ch.diverge(1, onset=11)
    ch.fit = {"state": "done", "error": None}
    scheduler.tick()
    retry = launcher.of_run(run_id)[1]
    assert "preflight" not in retry.launch  # its setup has been seen to work


def test_preflight_off_when_its_timeout_is_zero(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    make_scheduler(preflight_timeout_seconds=0).tick()
    assert "preflight" not in launcher.of_run(run_id)[0].launch


def test_a_config_error_found_by_the_preflight_fails_the_run_without_a_restart(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    launcher.of_run(run_id)[0].preflight("config_error", MISSING)
    scheduler.tick()
    scheduler.tick()

    _assert_failed_as_config_error(session_factory, run_id, "model.factory")
    assert len(launcher.of_run(run_id)) == 1 and launcher.of_run(run_id)[0].killed
    (only,) = attempts(session_factory, run_id)
    assert only.outcome is not None and only.outcome["stage"] == "preflight"
    assert only.ray_info["preflight"] == {"status": "config_error", "seconds": 0.5, "error": MISSING}
    assert only.started_at is None  # pending → config_error: it never ran
    hops = [(e.entity, e.from_state, e.to_state) for e in _run_log(session_factory, run_id)]
    assert hops[-2:] == [("attempt", "pending", "config_error"), ("run", "starting", "failed")]


def test_a_setup_error_the_workers_report_fails_the_run_without_a_restart(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.preflight("ok")
    ch.setup_error(1, "distributed.compression: bf16 compression needs NCCL (resources.use_gpu: true)")
    scheduler.tick()

    _assert_failed_as_config_error(session_factory, run_id, "distributed.compression")
    (only,) = attempts(session_factory, run_id)
    assert only.outcome is not None and only.outcome["stage"] == "setup"
    assert only.ray_info["preflight"]["status"] == "ok"


def test_a_ranks_setup_error_without_rank_0s_end_is_a_config_error_too(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    launcher.of_run(run_id)[0].setup_error(1, "data.factory: must return (inputs, targets)", with_end=False)
    scheduler.tick()
    _assert_failed_as_config_error(session_factory, run_id, "data.factory")


def test_a_setup_error_beside_a_dead_rank_is_a_crash(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.fit = {"state": "failed", "error": "x", "worker_failures": [
        {"rank": 0, "type": "SetupConfigError", "message": "model.factory: x", "died": False},
        {"rank": 1, "type": "ActorDiedError", "message": "died", "died": True},
    ]}
    scheduler.tick()
    first, second = attempts(session_factory, run_id)
    assert (first.state, second.kind) == ("crashed", "crash_restart")


def test_an_inconclusive_preflight_lets_the_attempt_run_and_is_recorded(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.preflight("inconclusive", "the probe did not finish within 300 s")
    ch.metrics(1, range(3))
    scheduler.tick()
    ch.succeed(1, 100)
    scheduler.tick()

    run = load(session_factory, run_id)
    assert (run.state, run.failure_kind) == ("succeeded", None)
    started = [e for e in _run_log(session_factory, run_id) if e.entity == "attempt" and e.to_state == "running"]
    assert started[0].reason == "workers started (preflight inconclusive in 0.5 s: the probe did not finish " \
                                "within 300 s)"
    assert started[0].data["preflight"]["status"] == "inconclusive"


def test_a_preflight_that_passed_is_in_the_log(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.preflight("ok")
    ch.metrics(1, range(3))
    scheduler.tick()
    started = [e for e in _run_log(session_factory, run_id) if e.entity == "attempt" and e.to_state == "running"]
    assert started[0].reason == "workers started (preflight ok in 0.5 s)"


def test_a_missing_code_path_is_a_config_error_at_launch_before_any_ray_work(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory, recipe_doc(code={"py_modules": [str(tmp_path / "nowhere")]}))
    make_scheduler().tick()
    assert launcher.of_run(run_id) == []
    _assert_failed_as_config_error(session_factory, run_id, "code.py_modules.0")
    (only,) = attempts(session_factory, run_id)
    assert only.outcome is not None and only.outcome["stage"] == "launch"


def test_pip_is_refused_at_launch_unless_the_server_allows_it(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    refused = submit(session_factory, recipe_doc(code={"pip": ["einops"]}))
    make_scheduler().tick()
    _assert_failed_as_config_error(session_factory, refused, "code.pip")
    allowed = submit(session_factory, recipe_doc(code={"pip": ["einops"]}))
    make_scheduler("sched-b", allow_runtime_pip=True, runtime_env={"pip": ["numpy"], "env_vars": {"A": "1"}}).tick()
    (ch,) = launcher.of_run(allowed)
    assert ch.launch["runtime_env"] == {"pip": ["numpy", "einops"], "env_vars": {"A": "1"}}


def test_the_code_section_becomes_the_launchs_runtime_env(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "wd").mkdir()
    plain = submit(session_factory)
    shipped = submit(session_factory, recipe_doc(code={"working_dir": str(tmp_path / "wd"),
                                                       "py_modules": [str(tmp_path / "pkg"), "s3://b/x.zip"]}))
    make_scheduler().tick()
    assert "runtime_env" not in launcher.of_run(plain)[0].launch
    assert launcher.of_run(shipped)[0].launch["runtime_env"] == {
        "working_dir": str(tmp_path / "wd"), "py_modules": [str(tmp_path / "pkg"), "s3://b/x.zip"]}


def test_a_manual_retry_after_a_config_error_probes_again_and_clears_the_kind(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    launcher.of_run(run_id)[0].preflight("config_error", MISSING)
    scheduler.tick()
    with transaction(session_factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        request_retry(session=s, run=run, by="alice")
    assert load(session_factory, run_id).failure_kind is None  # back in the queue
    scheduler.tick()
    second = launcher.of_run(run_id)[1]
    assert second.launch["spec"]["attempt"] == 2 and "preflight" in second.launch
