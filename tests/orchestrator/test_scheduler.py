"""The scheduler's decisions on both backends, with a scripted launcher in place of Ray (fast; the same paths run
against real Ray in ``test_scheduler_e2e.py``).

The fake channel (``tests/orchestrator/fakes.py``) behaves like ``orchestrator.channel.RunChannel`` as the
scheduler sees it: events with per-attempt seq numbers (dropped once acked), open plan requests, the fit's state;
``kill`` makes it unreachable.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

import orchestrator.scheduler.service as service_mod
from contracts.wire import ANOMALY_KINDS
from orchestrator.scheduler import Scheduler
from orchestrator.store.checkpoints import CORRUPT_KIND
from orchestrator.store.db import make_engine, make_session_factory, transaction
from orchestrator.store.models import AnomalyRow, CheckpointRow, Event, MetricPoint, Run
from orchestrator.store.repo import request_cancel, request_retry
from tests.orchestrator.fakes import (
    FakeChannel,
    FakeLauncher,
    attempts,
    ckpt_path,
    load,
    make_settings,
    orphan,
    recipe_doc,
    run_events,
    submit,
)


# ------------------------------------------------------------------------------------------------ claim
def test_claims_up_to_max_concurrent_runs_and_the_free_cpus(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    first = [submit(session_factory) for _ in range(3)]
    scheduler = make_scheduler(max_concurrent_runs=2)
    scheduler.tick()
    assert [c.run_id for c in launcher.launches] == first[:2]
    states = [load(session_factory, r).state for r in first]
    assert states == ["starting", "starting", "queued"]
    started = load(session_factory, first[0])
    assert started.claimed_by == "sched-a" and started.lease_expires_at is not None
    (attempt,) = attempts(session_factory, first[0])
    assert (attempt.number, attempt.kind, attempt.state) == (1, "initial", "pending")
    assert attempt.ray_info["channel"] == launcher.launches[0].name
    launch = launcher.launches[0].launch
    assert launch["run_name"] == f"run-{first[0]}-attempt-1"
    assert launch["spec"]["attempt"] == 1 and launch["spec"]["resume_from"] is None
    assert launch["checkpoint_uri_prefix"].endswith(f"/run-{first[0]}-attempt-1")

    # a run that needs more CPUs than are free waits in the queue, unclaimed
    launcher.cpus = 2.0  # two running 1-CPU runs use them all
    big = submit(session_factory, recipe_doc(resources={"num_workers": 2}))
    other = make_scheduler("sched-b", max_concurrent_runs=4)
    other.tick()
    assert load(session_factory, big).state == "queued" and load(session_factory, big).claimed_by is None
    assert load(session_factory, first[2]).state == "queued"  # 1 CPU needed, none free


def test_two_schedulers_never_claim_the_same_run(
    db_url: str, tmp_path: Path, session_factory: sessionmaker[Session]
) -> None:
    runs = [submit(session_factory) for _ in range(16)]
    launcher = FakeLauncher(cpus=1000.0)
    schedulers = []
    engines = []
    for name in ("sched-a", "sched-b"):
        engine = make_engine(db_url)  # each scheduler its own connection pool, as two processes would have
        engines.append(engine)
        schedulers.append(Scheduler(make_settings(db_url, tmp_path, max_concurrent_runs=16),
                                    make_session_factory(engine), name, launcher=launcher))
    barrier = threading.Barrier(2)
    errors: list[BaseException] = []

    def work(s: Scheduler) -> None:
        try:
            barrier.wait()
            for _ in range(4):
                s.tick()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in schedulers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for engine in engines:
        engine.dispose()
    assert not errors
    launched = sorted(c.run_id for c in launcher.launches)
    assert launched == runs  # every run launched exactly once
    with transaction(session_factory) as s:
        claims = dict(s.execute(sa.select(Run.id, Run.claimed_by)).tuples().all())
        starting_events = s.scalar(sa.select(sa.func.count()).select_from(Event).where(Event.to_state == "starting"))
    by_run = {c.run_id: c.name for c in launcher.launches}
    for run_id in runs:
        owner = claims[run_id]
        assert owner in ("sched-a", "sched-b")
        assert run_id in schedulers[0 if owner == "sched-a" else 1].active_runs
        assert by_run[run_id].startswith(f"ballast-r{run_id}-a1-")
    assert starting_events == len(runs)
    assert not set(schedulers[0].active_runs) & set(schedulers[1].active_runs)


# ---------------------------------------------------------------------------------------------- events
def test_events_reach_the_store_and_the_run_goes_running(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.metrics(1, range(5))
    scheduler.tick()
    run = load(session_factory, run_id)
    assert run.state == "running" and run.last_step == 4
    assert attempts(session_factory, run_id)[0].state == "running"
    scheduler.tick()
    assert not ch.events  # acked on the next poll: the channel keeps nothing the store has
    with transaction(session_factory) as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(MetricPoint)) == 5
    ch.succeed(1, 100)
    scheduler.tick()
    run = load(session_factory, run_id)
    assert run.state == "succeeded" and run.reason == "attempt 1 succeeded after 100 steps"
    assert run.claimed_by is None and ch.killed and scheduler.active_runs == []
    assert [a.state for a in attempts(session_factory, run_id)] == ["succeeded"]


# ------------------------------------------------------------------------------------------- recovery
def _diverge_with_checkpoints(ch: FakeChannel, tmp_path: Path, onset: int = 25) -> dict[str, Any]:
    ch.metrics(1, range(onset))
    for step in (10, 20):
        ch.checkpoint(1, step, tmp_path / "ckpt")
    return ch.diverge(1, onset)




def test_in_place_recovery_answers_the_workers_with_the_next_attempt(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    end = _diverge_with_checkpoints(ch, tmp_path)
    ch.requests[1] = {"attempt": 1, "end": end}
    scheduler.tick()

    plan = ch.answers[1]
    assert plan is not None and plan["attempt"] == 2
    assert plan["spec"]["attempt"] == 2
    assert plan["spec"]["recipe"]["optimizer"]["lr"] == pytest.approx(0.001)
    assert plan["spec"]["resume_from"] == ckpt_path(tmp_path, 20)
    first, second = attempts(session_factory, run_id)
    assert (first.state, first.onset_step) == ("diverged", 25)
    assert (second.kind, second.state, second.resume_step) == ("numeric_retry", "running", 20)
    assert second.overrides == {"optimizer.lr": [0.002, 0.001]}
    assert second.plan["in_place"] is True and second.ray_info["channel"] == ch.name
    assert "attempt 1 diverged (onset at step 25" in (second.reason or "")
    run = load(session_factory, run_id)
    assert (run.state, run.current_attempt, run.retries_used) == ("running", 2, 1)
    assert len(launcher.launches) == 1  # no new worker group

    ch.metrics(2, range(20, 100))
    ch.succeed(2, 100)
    scheduler.tick()
    run = load(session_factory, run_id)
    assert run.state == "succeeded"
    assert [("run", "running", "recovering"), ("run", "recovering", "running")] == [
        e for e in run_events(session_factory, run_id) if e[1] in ("running", "recovering") and e[0] == "run"
        and e[2] in ("recovering", "running")]
    with transaction(session_factory) as s:
        counts = dict(s.execute(sa.select(MetricPoint.attempt_id, sa.func.count()).group_by(MetricPoint.attempt_id)
                                ).tuples().all())
    assert counts == {first.id: 25, second.id: 80}


def test_without_in_place_a_divergence_restarts_the_worker_group(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory, recipe_doc(recovery={"in_place": False}))
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    _diverge_with_checkpoints(ch, tmp_path)
    ch.fit = {"state": "done", "error": None}
    scheduler.tick()

    assert ch.killed
    first, second = attempts(session_factory, run_id)
    assert first.state == "diverged"
    assert (second.kind, second.state, second.resume_step) == ("numeric_retry", "pending", 20)
    assert second.overrides == {"optimizer.lr": [0.002, 0.001]}
    restart = launcher.of_run(run_id)[1]
    assert restart.launch["spec"]["attempt"] == 2
    assert restart.launch["spec"]["resume_from"] == ckpt_path(tmp_path, 20)
    assert restart.launch["spec"]["rewarm_steps"] == 20
    assert restart.launch["run_name"] == f"run-{run_id}-attempt-2"
    assert load(session_factory, run_id).state == "starting"
    assert ("run", "recovering", "starting") in run_events(session_factory, run_id)


def test_a_crash_resumes_from_the_newest_checkpoint_without_tightening(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.metrics(1, range(35))
    ch.checkpoint(1, 10, tmp_path / "ckpt")
    ch.checkpoint(1, 30, tmp_path / "ckpt", healthy=False)
    ch.fit = {"state": "failed", "error": (
        "ray.train.WorkerGroupError: Training failed due to worker errors:\n[Rank 0 Error Snippet]:\n"
        "The actor died unexpectedly before finishing this task.\n")}
    scheduler.tick()

    first, second = attempts(session_factory, run_id)
    assert first.state == "crashed"
    assert first.outcome is not None and first.outcome["error"].startswith("worker rank 0 died")
    assert (second.kind, second.resume_step, second.overrides) == ("crash_restart", 30, {})
    assert launcher.of_run(run_id)[1].launch["spec"]["resume_from"] == ckpt_path(tmp_path, 30)
    run = load(session_factory, run_id)
    assert (run.crash_restarts_used, run.retries_used) == (1, 0)
    assert "attempt 1 crashed (worker rank 0 died" in (second.reason or "")


def test_a_corrupt_newest_checkpoint_is_skipped(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    for step in (10, 20):
        ch.checkpoint(1, step, tmp_path / "ckpt")
    data = Path(ckpt_path(tmp_path, 20)) / "model.pt"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF  # same size, different bytes: only the checksum can tell
    data.write_bytes(bytes(raw))
    ch.fit = {"state": "failed", "error": "RuntimeError: boom"}
    scheduler.tick()

    second = attempts(session_factory, run_id)[1]
    assert (second.kind, second.resume_step) == ("crash_restart", 10)
    with transaction(session_factory) as s:
        rows = {r.step: r for r in s.scalars(sa.select(CheckpointRow))}
        anomalies = [(a.kind, a.step, a.detector) for a in s.scalars(sa.select(AnomalyRow))]
        assert "sha256 mismatch" in rows[20].verdict["corrupt"] and rows[20].healthy is False
        assert "corrupt" not in rows[10].verdict and rows[10].healthy is True
    # recorded and shown like any anomaly, on the attempt that wrote the checkpoint
    assert ("checkpoint_corrupt", 20, "verification") in anomalies
    assert CORRUPT_KIND in ANOMALY_KINDS


def test_a_manual_retry_verifies_its_checkpoint_before_launch(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    """The API picks a manual retry's checkpoint without reading storage; the scheduler verifies it at launch, so
    a corrupt one is marked and the next valid one used, with no crash restart spent on it."""
    run_id = submit(session_factory, recipe_doc(recovery={"max_crash_restarts": 0}))
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    for step in (10, 20):
        ch.checkpoint(1, step, tmp_path / "ckpt")
    ch.fit = {"state": "failed", "error": "RuntimeError: boom"}
    scheduler.tick()
    assert load(session_factory, run_id).state == "failed"  # no crash restarts allowed
    data = Path(ckpt_path(tmp_path, 20)) / "model.pt"
    raw = bytearray(data.read_bytes())
    raw[-5] ^= 0xFF
    data.write_bytes(bytes(raw))
    with transaction(session_factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        retry = request_retry(session=s, run=run, by="alice")
        assert retry.resume_step == 20  # what the API could see: the newest healthy checkpoint
    scheduler.tick()
    manual = attempts(session_factory, run_id)[-1]
    assert (manual.kind, manual.resume_step) == ("manual", 10)
    assert "step-20 checkpoint failed verification" in (manual.reason or "")
    assert launcher.of_run(run_id)[-1].launch["spec"]["resume_from"] == ckpt_path(tmp_path, 10)
    with transaction(session_factory) as s:
        row20 = s.scalars(sa.select(CheckpointRow).where(CheckpointRow.step == 20)).one()
        assert row20.healthy is False and "sha256 mismatch" in row20.verdict["corrupt"]
        kinds = [a.kind for a in s.scalars(sa.select(AnomalyRow).where(AnomalyRow.run_id == run_id))]
    assert kinds.count(CORRUPT_KIND) == 1
    assert load(session_factory, run_id).crash_restarts_used == 0


def test_a_run_that_keeps_diverging_fails_when_its_retries_are_spent(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory, recipe_doc(recovery={"max_retries": 1}))
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.requests[1] = {"attempt": 1, "end": _diverge_with_checkpoints(ch, tmp_path)}
    scheduler.tick()
    assert ch.answers[1] is not None
    ch.requests[2] = {"attempt": 2, "end": ch.diverge(2, 22)}
    scheduler.tick()

    assert ch.answers[2] is None and ch.killed
    run = load(session_factory, run_id)
    assert run.state == "failed"
    assert run.reason is not None and "numeric retry budget exhausted (1/1)" in run.reason
    assert [a.state for a in attempts(session_factory, run_id)] == ["diverged", "diverged"]
    assert run.claimed_by is None and scheduler.active_runs == []


def test_retention_keeps_the_newest_and_the_newest_healthy(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory)  # keep: 2
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    paths = {step: ch.checkpoint(1, step, tmp_path / "ckpt", healthy=healthy)
             for step, healthy in ((10, True), (20, True), (30, False), (40, False))}
    scheduler.tick()
    with transaction(session_factory) as s:
        deleted = {r.step: r.deleted for r in s.scalars(sa.select(CheckpointRow))}
    assert deleted == {10: True, 20: False, 30: False, 40: False}
    assert [Path(paths[step]).exists() for step in (10, 20, 30, 40)] == [False, True, True, True]


# ------------------------------------------------------------------------------------------ cancellation
def test_cancel_asks_the_workers_to_stop(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.metrics(1, range(3))
    scheduler.tick()
    with transaction(session_factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        request_cancel(session=s, run=run, by="alice")
    scheduler.tick()
    assert ch.stop and not ch.killed
    ch.emit(1, "end", {"outcome": "cancelled", "final_step": 4})
    scheduler.tick()
    run = load(session_factory, run_id)
    assert run.state == "cancelled" and ch.killed
    (attempt,) = attempts(session_factory, run_id)
    assert attempt.state == "cancelled" and "error" not in (attempt.outcome or {})


def test_cancel_kills_workers_that_do_not_stop(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(service_mod, "CANCEL_GRACE_S", -1.0)
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    with transaction(session_factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        request_cancel(session=s, run=run, by="alice")
    scheduler.tick()
    assert ch.stop and not ch.killed
    scheduler.tick()  # the workers never answered: past the grace period
    assert ch.killed
    run = load(session_factory, run_id)
    (attempt,) = attempts(session_factory, run_id)
    assert run.state == "cancelled" and attempt.state == "cancelled"
    assert attempt.outcome is not None and "did not stop in time" in attempt.outcome["error"]


# ------------------------------------------------------------------------------------------ crash safety
def test_a_new_scheduler_reattaches_to_work_that_still_runs(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    old = make_scheduler("sched-old")
    old.tick()
    ch = launcher.of_run(run_id)[0]
    ch.metrics(1, range(5))
    old.tick()
    orphan(session_factory, run_id)
    ch.metrics(1, range(5, 9))  # the worker group carried on while nobody drained it
    new = make_scheduler("sched-new")
    new.tick()
    assert new.active_runs == [run_id] and len(launcher.launches) == 1
    run = load(session_factory, run_id)
    assert run.claimed_by == "sched-new" and run.state == "running"
    new.tick()
    assert load(session_factory, run_id).last_step == 8
    ch.succeed(1, 100)
    new.tick()
    assert load(session_factory, run_id).state == "succeeded"
    assert [a.state for a in attempts(session_factory, run_id)] == ["succeeded"]
    with transaction(session_factory) as s:
        assert s.scalar(sa.select(sa.func.count()).select_from(MetricPoint)) == 9


def test_a_new_scheduler_resumes_runs_whose_work_is_gone(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory)
    old = make_scheduler("sched-old")
    old.tick()
    ch = launcher.of_run(run_id)[0]
    ch.metrics(1, range(12))
    ch.checkpoint(1, 10, tmp_path / "ckpt")
    old.tick()
    orphan(session_factory, run_id)
    ch.killed = True  # the local Ray died with the old scheduler
    new = make_scheduler("sched-new")
    new.tick()
    first, second = attempts(session_factory, run_id)
    assert first.state == "crashed" and "control plane was down" in (first.outcome or {}).get("error", "")
    assert (second.kind, second.resume_step, second.overrides) == ("crash_restart", 10, {})
    assert launcher.of_run(run_id)[1].launch["spec"]["resume_from"] == ckpt_path(tmp_path, 10)
    assert load(session_factory, run_id).state == "starting"


def test_a_live_lease_is_left_alone(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    make_scheduler("sched-a").tick()
    other = make_scheduler("sched-b")
    other.tick()
    assert other.active_runs == [] and load(session_factory, run_id).claimed_by == "sched-a"


def test_anomalies_reach_the_store(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.metrics(1, range(3))
    ch.emit(1, "anomaly", {"step": 2, "rank": 0, "kind": "grad_norm_spike", "detector": "grad_norm_spike",
                           "value": 50.0, "threshold": 6.0, "action": "skip_step", "details": {}})
    scheduler.tick()
    with transaction(session_factory) as s:
        row = s.scalars(sa.select(AnomalyRow)).one()
    assert (row.run_id, row.step, row.action) == (run_id, 2, "skip_step")


# --------------------------------------------------------------------------------- one transaction per tick
@pytest.mark.parametrize("chunk", [5000, 5], ids=["one-transaction", "chunks"])
def test_a_tick_stores_every_runs_events_and_a_bad_run_does_not_hold_the_others_back(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, chunk: int,
) -> None:
    """All runs' events of a tick go in together (or in chunks of about ``TRANSACTION_EVENTS``); when one run's
    events cannot be stored (an event names its attempt as "x"), its shared transaction is rolled back and each run
    serviced again on its own: the good runs' events are stored exactly once, the bad run's error is logged, and
    its events wait in the channel."""
    monkeypatch.setattr(service_mod, "TRANSACTION_EVENTS", chunk)
    runs = [submit(session_factory) for _ in range(3)]
    scheduler = make_scheduler(max_concurrent_runs=3)
    scheduler.tick()  # claims and launches all three
    channels = {r: launcher.of_run(r)[0] for r in runs}
    for ch in channels.values():
        ch.metrics(1, range(4))
    channels[runs[1]].events.append({"attempt": "x", "seq": 99, "type": "metric", "data": {"step": 9}})
    scheduler.tick()
    scheduler.tick()  # the good runs' events are acked (dropped from their channels); nothing is stored twice
    with transaction(session_factory) as s:
        stored = dict(s.execute(sa.select(MetricPoint.run_id, sa.func.count()).group_by(MetricPoint.run_id)).all())
    assert stored == {runs[0]: 4, runs[2]: 4}
    assert [load(session_factory, r).state for r in runs] == ["running", "starting", "running"]
    assert channels[runs[0]].events == [] and channels[runs[2]].events == []
    assert len(channels[runs[1]].events) == 5
    assert f"servicing run {runs[1]} failed" in caplog.text
