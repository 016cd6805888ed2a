"""Standby worker groups (``Settings.standby_worker_groups``): a worker group of the common shape started ahead of
demand, handed to the first run that fits it.

The matching rule and the channel's adoption bookkeeping are plain code; the rest runs on the session's Ray with
the real scheduler and Ray Train workers: a run that fits trains (and rolls back in place) on the standby, a run
that does not fit retires it for its CPUs, and a dead scheduler's idle standby is cleaned up by the next one.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

import migrations
from orchestrator.channel import NAMESPACE, RunChannel, channel_actor_class
from orchestrator.scheduler import RayLauncher, Scheduler
from orchestrator.scheduler.launcher import STANDBY_PREFIX, fits_standby
from orchestrator.settings import Settings
from orchestrator.store.db import make_engine, make_session_factory, transaction
from orchestrator.store.models import Run
from tests.orchestrator.test_scheduler_e2e import attempts_of, drive, steps_of, submit, tiny_recipe

TEMPLATE: dict[str, Any] = {"storage_path": "/ckpt", "storage": {}, "num_workers": 1, "cpus_per_worker": 1.0,
                            "use_gpu": False, "gpus_per_worker": 0.0}


@pytest.mark.parametrize(("change", "fits"), [
    ({}, True),
    ({"num_workers": 2}, False),
    ({"cpus_per_worker": 2.0}, False),
    ({"use_gpu": True}, False),
    ({"runtime_env": {"py_modules": ["gcs://x.zip"]}}, False),
    ({"preflight": {"timeout_s": 300.0}}, False),
    ({"train_fn": "tests.fn:loop"}, False),
    ({"storage_path": "/elsewhere"}, False),
    ({"storage": {"endpoint_url": "http://minio"}}, False),
])
def test_a_launch_fits_a_standby_only_when_the_standby_was_started_for_it(change: dict[str, Any], fits: bool) -> None:
    launch = {**TEMPLATE, "spec": {}, "attempt": 1, "run_name": "run-1-attempt-1", **change}
    assert fits_standby(launch, TEMPLATE) is fits


def test_an_adopted_standby_hands_its_worker_the_launch_once() -> None:
    ch = RunChannel(0, 0, owner="host:1:abc")
    assert ch.take_launch() is None  # nothing yet: the worker keeps waiting
    state = ch.standby_state()
    assert (state["ready"], state["adopted"], state["owner"]) == (False, False, "host:1:abc")
    ch.adopt(7, 2, {"attempt": 2, "spec": {"x": 1}})
    assert (ch.run_id, ch.first_attempt) == (7, 2)
    assert ch.take_launch() == {"attempt": 2, "spec": {"x": 1}}
    assert ch.take_launch() is None
    assert ch.standby_state()["adopted"] is True
    with pytest.raises(RuntimeError, match="already adopted"):
        ch.adopt(8, 1, {})


def test_a_touch_resets_the_time_a_standby_has_gone_untouched() -> None:
    ch = RunChannel(0, 0, owner="host:1:abc")
    ch._touched -= 150.0  # as if its scheduler last asked 150 s ago
    assert ch.standby_state()["untouched_s"] >= 150.0
    # the fit's state and the placement groups, for the scheduler's pruning and cleanup
    assert ch.touch() == {"fit": {"state": "idle", "error": None}, "placement_groups": []}
    assert ch.standby_state()["untouched_s"] < 150.0


# --------------------------------------------------------------------------------------------- on Ray
@dataclass
class Standing:
    """A scheduler with one standby worker group ready (``standby``: its channel's name)."""

    settings: Settings
    factory: sessionmaker[Session]
    scheduler: Scheduler
    launcher: RayLauncher
    standby: str


@pytest.fixture
def standing(ray_cluster: Any, tmp_path: Path) -> Iterator[Standing]:
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'ballast.db'}",
                        checkpoint_root=str(tmp_path / "checkpoints"), scheduler_poll_seconds=0.3,
                        max_concurrent_runs=2, standby_worker_groups=1)
    migrations.upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    factory = make_session_factory(engine)
    scheduler = Scheduler(settings, factory)
    launcher = scheduler.ctx.launcher
    assert isinstance(launcher, RayLauncher)
    try:
        standby = tick_until_a_standby_is_ready(scheduler, launcher)
        yield Standing(settings, factory, scheduler, launcher, standby)
    finally:
        launcher.shutdown()  # the standbys are detached actors: they outlive a scheduler that is not stopped
        engine.dispose()
    # nothing leaked: every CPU free again is checked for every test on the session Ray (tests/conftest.py)


def tick_until_a_standby_is_ready(scheduler: Scheduler, launcher: RayLauncher) -> str:
    """Tick until a standby is ready *and* its scheduler has seen its placement group: a test that kills it must
    not do so in the moment between the two, which no tick covers (its group would then be freed by no one)."""
    import ray

    deadline = time.monotonic() + 300.0
    while time.monotonic() < deadline:
        scheduler.tick()
        for name, handle in launcher._standbys.items():
            if name in launcher._standby_groups and ray.get(handle.standby_state.remote(), timeout=30)["ready"]:
                return name
        time.sleep(0.3)
    raise AssertionError("no standby became ready")


def gone_soon(name: str) -> bool:
    """The named actor is gone (``ray.kill`` takes a moment to unregister the name)."""
    import ray

    deadline = time.monotonic() + 60.0
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return True
        time.sleep(0.2)
    return False


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_that_fits_trains_on_the_standby_rolls_back_in_place_and_a_new_standby_starts_behind_it(
    standing: Standing,
) -> None:
    factory = standing.factory
    doc = tiny_recipe(name="on-standby", training={"max_steps": 40},
                      faults=[{"type": "grad_scale", "step": 25, "factor": 1e4, "attempt": 1}])
    run_id = submit(factory, doc)
    drive(standing.scheduler, factory, run_id)

    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None and run.state == "succeeded", run.reason if run else None
    first, second = attempts_of(factory, run_id)
    assert first.ray_info["channel"] == standing.standby and first.ray_info["standby"] is True
    assert (first.state, first.onset_step) == ("diverged", 25)
    # the rollback ran in the same (standby) worker group, from the newest healthy checkpoint
    assert second.ray_info.get("in_place") is True and second.state == "succeeded"
    assert steps_of(factory, second.id) == list(range(second.resume_step, 40))
    assert steps_of(factory, first.id)[:3] == [0, 1, 2]
    # a new standby took the freed CPU's place, under another name
    assert standing.launcher._standbys and standing.standby not in standing.launcher._standbys


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_that_does_not_fit_retires_the_standby_for_its_cpus(standing: Standing) -> None:
    # two workers of one CPU each on the 2-CPU Ray: only if the standby gives its CPU back
    run_id = submit(standing.factory, tiny_recipe(name="two-workers", resources={"num_workers": 2}))
    standing.scheduler.tick()  # the claim: the standby's CPU counts as free, and the launch retires it
    assert gone_soon(standing.standby)
    drive(standing.scheduler, standing.factory, run_id)
    (attempt,) = attempts_of(standing.factory, run_id)
    assert attempt.state == "succeeded" and "standby" not in attempt.ray_info
    assert not attempt.ray_info["channel"].startswith(STANDBY_PREFIX)


@pytest.mark.ray
@pytest.mark.timeout(600)
def test_a_standby_that_dies_while_it_waits_is_replaced(standing: Standing) -> None:
    import ray

    launcher, dead = standing.launcher, standing.standby
    ray.kill(launcher._standbys[dead], no_restart=True)  # its process is gone, as in a node failure
    deadline = time.monotonic() + 60.0
    while dead in launcher._standbys or not launcher._standbys:
        assert time.monotonic() < deadline, "the dead standby was not replaced"
        standing.scheduler.tick()
        time.sleep(0.3)
    # and a run that fits is not handed to the dead one
    settings = standing.settings
    assert launcher.standby_for({**TEMPLATE, "storage_path": settings.checkpoint_root,
                                 "storage": settings.checkpoint_storage().to_dict()}) != dead


@pytest.mark.ray
def test_an_idle_standby_of_a_gone_scheduler_is_retired_and_an_adopted_one_is_not(
    ray_cluster: Any, tmp_path: Path
) -> None:
    import ray

    # a scheduler id of this host whose process has exited, and one of another host (a replaced pod)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_here = f"{socket.gethostname()}:{int(gone.stdout)}:dead"
    elsewhere = "another-host:1:alive-or-not"
    cls = channel_actor_class()
    made = {name: cls.options(name=f"{STANDBY_PREFIX}{name}", namespace=NAMESPACE, lifetime="detached")
            .remote(0, 0, owner) for name, owner in
            [("dead-here", dead_here), ("elsewhere", elsewhere), ("adopted", dead_here)]}
    ray.get(made["adopted"].adopt.remote(5, 1, {"attempt": 1}))  # a run's channel now: never touched
    try:
        launcher = RayLauncher(Settings(home=tmp_path, standby_worker_groups=1), owner="this-host:1:me")
        launcher.connect()
        assert gone_soon(f"{STANDBY_PREFIX}dead-here")
        # another host's standby is left alone while it may still be touched by its scheduler ...
        ref: Any = made["elsewhere"].standby_state.remote()
        assert ray.get(ref)["adopted"] is False
        # ... and retired once nobody has touched it for ORPHAN_S
        launcher.ORPHAN_S = 0.0
        launcher.connect()
        assert gone_soon(f"{STANDBY_PREFIX}elsewhere")
        ref = ray.get_actor(f"{STANDBY_PREFIX}adopted", namespace=NAMESPACE).standby_state.remote()
        assert ray.get(ref)["adopted"] is True
    finally:
        for h in made.values():
            ray.kill(h, no_restart=True)
