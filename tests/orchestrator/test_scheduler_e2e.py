"""The closed loop end to end: real Ray Train workers, the real scheduler, a SQLite store.

Tiny recipes (a 1-layer ``tiny_gpt``, tens of steps) so each test costs one or two worker-group start-ups. The
faults come from the recipe and fire only in the attempt they name; the detectors find them from the numbers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.orm import Session, sessionmaker

import migrations
from contracts.recipe import load_recipe, validate_recipe_data
from orchestrator.scheduler import Scheduler
from orchestrator.settings import Settings
from orchestrator.store.db import make_engine, make_session_factory, transaction
from orchestrator.store.models import AnomalyRow, Attempt, CheckpointRow, MetricPoint, Run
from orchestrator.store.repo import create_run, request_cancel
from tests.recipes import EXPLODING_RNN, SLOW_LSTM, recipe_doc

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
DEADLINE_S = 420.0  # generous: the CI machine is shared; nothing here asserts on time


TINY: dict[str, Any] = {
    "name": "tiny",
    "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 1, "n_heads": 2, "d_model": 32},
    "data": {"name": "markov", "vocab_size": 32, "seq_len": 16},
    "training": {"max_steps": 60, "batch_size": 8, "seed": 1},
    "optimizer": {"name": "adamw", "lr": 0.003},
    "schedule": {"warmup_steps": 5, "decay": "constant"},
    "checkpoint": {"every_steps": 10, "keep": 3},
    "detectors": {"grad_norm_spike": {"action": "rollback", "warmup_steps": 10}},
    "recovery": {"rewarm_steps": 5},
    "faults": [],
}
tiny_recipe = partial(recipe_doc, TINY)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Settings, sessionmaker[Session]]]:
    settings = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'ballast.db'}",
                        checkpoint_root=str(tmp_path / "checkpoints"), scheduler_poll_seconds=0.3,
                        max_concurrent_runs=2)
    migrations.upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    yield settings, make_session_factory(engine)
    engine.dispose()


def submit(factory: sessionmaker[Session], doc: dict[str, Any]) -> int:
    with transaction(factory) as s:
        run, _ = create_run(session=s, owner="tester", recipe=validate_recipe_data(doc), text=yaml.safe_dump(doc))
        return run.id


def snapshot(factory: sessionmaker[Session], run_id: int) -> tuple[str, int, int]:
    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        metrics = s.scalar(sa.select(sa.func.count()).select_from(MetricPoint).where(MetricPoint.run_id == run_id))
        return run.state, run.current_attempt, int(metrics or 0)


def drive(scheduler: Scheduler | None, factory: sessionmaker[Session], run_id: int,
          until: Callable[[tuple[str, int, int]], bool] | None = None) -> list[tuple[str, int, int]]:
    """Tick until the run ends (or ``until`` holds); returns what the store showed along the way."""
    seen: list[tuple[str, int, int]] = []
    stop_at = time.monotonic() + DEADLINE_S
    while time.monotonic() < stop_at:
        if scheduler is not None:
            scheduler.tick()
        snap = snapshot(factory, run_id)
        seen.append(snap)
        if (until is not None and until(snap)) or snap[0] in ("succeeded", "failed", "cancelled"):
            return seen
        time.sleep(0.3)
    raise AssertionError(f"run {run_id} did not get there; last seen {seen[-1:]}")


def attempts_of(factory: sessionmaker[Session], run_id: int) -> list[Attempt]:
    with transaction(factory) as s:
        return list(s.scalars(sa.select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)))


def steps_of(factory: sessionmaker[Session], attempt_id: int) -> list[int]:
    with transaction(factory) as s:
        return list(s.scalars(sa.select(MetricPoint.step).where(MetricPoint.attempt_id == attempt_id)
                              .order_by(MetricPoint.step)))


def test_a_diverging_run_rolls_back_to_a_healthy_checkpoint_and_succeeds(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]]
) -> None:
    """The example recipe recipes/unstable-nan.yaml as submitted: a NaN loss in attempt 1."""
    settings, factory = store
    text = (REPO / "recipes" / "unstable-nan.yaml").read_text()
    recipe = load_recipe(text)
    (fault,) = recipe.faults
    every, max_steps, lr = recipe.checkpoint.every_steps, recipe.training.max_steps, recipe.optimizer.lr
    resume = fault.step // every * every  # the newest checkpoint before the onset (all healthy until then)
    with transaction(factory) as s:
        run_id = create_run(session=s, owner="tester", recipe=recipe, text=text)[0].id
    seen = drive(Scheduler(settings, factory), factory, run_id)

    assert seen[-1][0] == "succeeded"
    # metrics were in the store while attempt 1 was still running, not only at the end
    assert any(state == "running" and attempt == 1 and metrics > 0 for state, attempt, metrics in seen)
    first, second = attempts_of(factory, run_id)
    assert (first.state, first.onset_step) == ("diverged", fault.step)
    assert (second.kind, second.state, second.resume_step) == ("numeric_retry", "succeeded", resume)
    # the plan halved the LR, and its probe first replayed the diverged settings from the checkpoint through the
    # NaN's step: the fault fires only in attempt 1, so the replay trained cleanly and the settings were kept
    assert second.overrides == {}
    assert second.plan["in_place"] is True and second.plan["lr_probe"]["chosen"] == lr
    assert [c["lr"] for c in second.plan["lr_probe"]["candidates_run"]] == [lr]  # a clean replay ends the probe
    assert second.plan["lr_probe"]["candidates"][:2] == [lr, lr * recipe.recovery.lr_factor]
    rewarm = recipe.recovery.rewarm_steps
    assert rewarm > 0 and second.plan["rewarm_steps"] == 0
    assert second.reason is not None and f"attempt 1 diverged (onset at step {fault.step}" in second.reason
    assert f"resumed from step {resume}" in second.reason and "lr 0.003→0.0015" in second.reason
    assert "the first replays the diverged settings" in second.reason
    assert "kept (optimizer.lr 0.0015→0.003" in second.reason
    with transaction(factory) as s:
        parent = s.get(CheckpointRow, second.parent_checkpoint_id)
        assert parent is not None and (parent.attempt_id, parent.step, parent.healthy) == (first.id, resume, True)
        checkpoints = list(s.scalars(sa.select(CheckpointRow).where(CheckpointRow.run_id == run_id)))
        anomalies = list(s.scalars(sa.select(AnomalyRow).where(AnomalyRow.run_id == run_id)))
    assert {c.step for c in checkpoints if c.attempt_id == second.id} == set(range(resume + every, max_steps + 1,
                                                                                     every))
    assert all({"weights_finite", "loss_in_bounds"} <= set(c.verdict) for c in checkpoints)
    assert [(a.attempt_id, a.step) for a in anomalies if a.action == "rollback"] == [(first.id, fault.step)]
    assert steps_of(factory, second.id) == list(range(resume, max_steps))
    # retention (keep K + the newest healthy): older checkpoints are marked deleted and gone from disk
    gone = [c for c in checkpoints if c.deleted]
    assert gone and all(not Path(c.uri).exists() for c in gone)


def test_a_killed_worker_is_resumed_from_the_newest_checkpoint_without_tightening(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]]
) -> None:
    settings, factory = store
    doc = tiny_recipe(name="killed-worker", training={"max_steps": 40}, resources={"num_workers": 2},
                      faults=[{"type": "kill_worker", "step": 25, "attempt": 1, "rank": 1}])
    run_id = submit(factory, doc)
    drive(Scheduler(settings, factory), factory, run_id)

    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None and run.state == "succeeded"
        assert (run.crash_restarts_used, run.retries_used) == (1, 0)
    first, second = attempts_of(factory, run_id)
    assert first.state == "crashed"
    assert first.outcome is not None and "worker rank 1 died" in first.outcome["error"]
    assert (second.kind, second.state, second.resume_step, second.overrides) == (
        "crash_restart", "succeeded", 20, {})
    assert second.ray_info["run_name"] == f"run-{run_id}-attempt-2"  # a fresh worker group
    assert steps_of(factory, second.id) == list(range(20, 40))


def test_a_run_that_keeps_diverging_fails_with_the_reason(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]]
) -> None:
    settings, factory = store
    doc = tiny_recipe(name="keeps-diverging", training={"max_steps": 40}, recovery={"max_retries": 1},
                      faults=[{"type": "grad_scale", "step": 25, "factor": 1e4, "attempt": 1},
                              {"type": "grad_scale", "step": 32, "factor": 1e4, "attempt": 2}])
    run_id = submit(factory, doc)
    drive(Scheduler(settings, factory), factory, run_id)

    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None and run.state == "failed"
        assert run.reason is not None and "attempt 2 diverged (onset at step 32" in run.reason
        assert "numeric retry budget exhausted (1/1)" in run.reason
    assert [(a.state, a.onset_step) for a in attempts_of(factory, run_id)] == [("diverged", 25), ("diverged", 32)]


def test_cancelling_stops_the_workers_and_ends_the_run_cancelled(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]]
) -> None:
    settings, factory = store
    run_id = submit(factory, tiny_recipe(name="to-cancel", training={"max_steps": 100_000}))
    scheduler = Scheduler(settings, factory)
    drive(scheduler, factory, run_id, until=lambda snap: snap[0] == "running" and snap[2] >= 3)
    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        request_cancel(session=s, run=run, by="tester")
    drive(scheduler, factory, run_id)

    (attempt,) = attempts_of(factory, run_id)
    assert snapshot(factory, run_id)[0] == "cancelled" and attempt.state == "cancelled"
    # the workers stopped themselves on request (the kill after the grace period leaves an error)
    assert attempt.outcome is not None and attempt.outcome.get("outcome") == "cancelled"
    assert "error" not in attempt.outcome
    with pytest.raises(ValueError):
        ray_cluster.get_actor(attempt.ray_info["channel"], namespace=attempt.ray_info["namespace"])


def test_a_killed_scheduler_is_replaced_and_the_run_ends_correctly(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]], tmp_path: Path
) -> None:
    settings, factory = store
    max_steps = 120
    run_id = submit(factory, tiny_recipe(name="survives-restart", training={"max_steps": max_steps}))
    env = {**os.environ, "BALLAST_DATABASE_URL": settings.database_url, "BALLAST_HOME": str(tmp_path),
           "BALLAST_CHECKPOINT_ROOT": settings.checkpoint_root, "BALLAST_SCHEDULER_POLL_SECONDS": "0.3",
           "BALLAST_RAY_ADDRESS": ray_cluster.get_runtime_context().gcs_address}
    log = (tmp_path / "scheduler.log").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "orchestrator.scheduler"], cwd=REPO, env=env,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        drive(None, factory, run_id, until=lambda snap: snap[0] == "running" and snap[2] >= 5)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        log.close()
    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None and run.state == "running" and run.claimed_by is not None  # left behind

    restarted = Scheduler(settings, factory)
    seen = drive(restarted, factory, run_id)
    assert seen[-1][0] == "succeeded", (tmp_path / "scheduler.log").read_text()[-3000:]
    (attempt,) = attempts_of(factory, run_id)  # reattached to the running worker group: no crash, no retry
    assert attempt.state == "succeeded"
    # nothing lost, nothing twice: every step exactly once, although the old scheduler died mid-stream
    assert steps_of(factory, attempt.id) == list(range(max_steps))


def test_a_hung_rank_is_noticed_by_the_step_deadline_and_the_attempt_resumed(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]]
) -> None:
    """Rank 1 of a 2-worker gloo group sleeps forever at step 25 (rank 0 then waits in the step's collectives):
    no step for ``step_timeout_s`` → the attempt is crashed with that reason, its group torn down, and the crash
    path resumes it from the newest checkpoint with the same settings."""
    settings, factory = store
    doc = tiny_recipe(name="hung-rank", training={"max_steps": 40},
                      resources={"num_workers": 2, "step_timeout_s": 8},
                      faults=[{"type": "hang", "step": 25, "attempt": 1, "rank": 1}])
    run_id = submit(factory, doc)
    drive(Scheduler(settings, factory), factory, run_id)

    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None and run.state == "succeeded"
        assert (run.crash_restarts_used, run.retries_used) == (1, 0)
    first, second = attempts_of(factory, run_id)
    assert first.state == "crashed" and first.outcome is not None
    assert first.outcome["error"].startswith("no step for 8 s (hung?)")
    assert (second.kind, second.state, second.resume_step, second.overrides) == (
        "crash_restart", "succeeded", 20, {})
    with pytest.raises(ValueError):  # the hung group was torn down
        ray_cluster.get_actor(first.ray_info["channel"], namespace=first.ray_info["namespace"])
    assert steps_of(factory, second.id) == list(range(20, 40))


def test_a_retry_probes_its_lr_and_trains_at_the_one_it_chose(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]]
) -> None:
    """An exploding tanh RNN (SGD at lr 1.0) blows up at once; the retry, in place, probes three LRs from
    initialisation, rejects the one that blows up again (seen by the detectors), trains at the chosen one, and the
    store holds that LR as the attempt's override, the probe's result in its plan and the choice in its reason."""
    settings, factory = store
    doc = recipe_doc(EXPLODING_RNN, name="lr-probe", schedule={"warmup_steps": 0, "decay": "constant"},
                     recovery={"rewarm_steps": 0, "lr_probe": {"mode": "on", "steps": 8}})
    run_id = submit(factory, doc)
    drive(Scheduler(settings, factory), factory, run_id)

    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None and run.state == "succeeded", run.reason
    first, second = attempts_of(factory, run_id)
    assert first.state == "diverged" and second.kind == "numeric_retry" and second.plan["in_place"] is True
    probe = second.plan["lr_probe"]
    assert probe["candidates"] == [0.25, 0.0625, 0.015625] and probe["steps"] == 8
    blown, *rest = probe["candidates_run"]
    assert blown["lr"] == 0.25 and blown["failed"] and all(c["failed"] is None for c in rest)
    assert probe["chosen"] in (0.0625, 0.015625)
    assert probe["steps_run"] == sum(c["steps"] for c in probe["candidates_run"])
    assert second.overrides["optimizer.lr"] == [1.0, probe["chosen"]]
    assert second.reason is not None and f"chose {probe['chosen']:.4g}" in second.reason
    with transaction(factory) as s:
        lrs = list(s.scalars(sa.select(MetricPoint.lr).where(MetricPoint.attempt_id == second.id)))
    # the early blow-up also added a warmup, but the chosen LR trained cleanly from step 0 at a constant LR: the
    # attempt drops it (its override is gone) and trains at the chosen LR from its first step (constant decay)
    assert probe["if_clean"] == {"schedule.warmup_steps": 0} and "schedule.warmup_steps" not in second.overrides
    assert len(lrs) == 40 and lrs == pytest.approx([probe["chosen"]] * 40)
    assert steps_of(factory, second.id) == list(range(40))  # restarted from initialisation; no probe step in it


def test_a_run_that_never_learned_is_retried_at_the_higher_lr_its_probe_climbed_to(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]]
) -> None:
    """An LSTM at Adam 1e-3 never learns the copy task; through the service the retry's probe tries 4x that LR
    first, climbs while the highest LR tried is the best, and the store records the LR it climbed to as the
    attempt's override, and the attempt trains at it."""
    settings, factory = store
    doc = recipe_doc(SLOW_LSTM, name="slow-lstm", training={**SLOW_LSTM["training"], "max_steps": 80},
                     recovery={"lr_probe": {"mode": "on", "steps": 8}})
    run_id = submit(factory, doc)
    drive(Scheduler(settings, factory), factory, run_id)

    first, second = attempts_of(factory, run_id)
    assert first.state == "diverged" and (first.outcome or {}).get("detector") == "never_learned"
    probe = second.plan["lr_probe"]
    lr = SLOW_LSTM["optimizer"]["lr"]
    assert probe["candidates"][0] == pytest.approx(4 * lr) and probe["extend"]
    ran = probe["candidates_run"]
    assert len(ran) > len(probe["candidates"])  # it climbed
    assert probe["chosen"] > 4 * lr and second.overrides["optimizer.lr"] == [lr, probe["chosen"]]
    with transaction(factory) as s:
        lrs = list(s.scalars(sa.select(MetricPoint.lr).where(MetricPoint.attempt_id == second.id)
                             .order_by(MetricPoint.step)))
    assert lrs[0] == pytest.approx(probe["chosen"])  # cosine decay from the chosen LR, no warmup
    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None and run.state == "succeeded", run.reason


def test_a_worker_killed_inside_the_probe_is_restarted_into_the_probe_again(
    ray_cluster: Any, store: tuple[Settings, sessionmaker[Session]]
) -> None:
    """The retry's worker is SIGKILLed at step 3 of its LR probe, before any choice or checkpoint: the crash restart
    runs the probe again (not the cut LR untried) and trains at what it chooses."""
    settings, factory = store
    doc = recipe_doc(EXPLODING_RNN, name="probe-crash", schedule={"warmup_steps": 0, "decay": "constant"},
                     recovery={"rewarm_steps": 0, "lr_probe": {"mode": "on", "steps": 8}},
                     faults=[{"type": "kill_worker", "step": 3, "attempt": 2}])
    run_id = submit(factory, doc)
    drive(Scheduler(settings, factory), factory, run_id)

    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None and run.state == "succeeded", run.reason
        assert (run.retries_used, run.crash_restarts_used) == (1, 1)
    first, second, third = attempts_of(factory, run_id)
    assert (first.state, second.kind, second.state, third.kind) == (
        "diverged", "numeric_retry", "crashed", "crash_restart")
    assert "chosen" not in second.plan["lr_probe"] and second.overrides["optimizer.lr"] == [1.0, 0.25]
    probe = third.plan["lr_probe"]
    assert probe["candidates"] == [0.25, 0.0625, 0.015625] and probe["chosen"] in (0.0625, 0.015625)
    assert third.overrides["optimizer.lr"] == [1.0, probe["chosen"]]
    assert third.reason is not None and "it crashed before its first checkpoint, so again lr probe of" in third.reason
    assert steps_of(factory, third.id) == list(range(40))
