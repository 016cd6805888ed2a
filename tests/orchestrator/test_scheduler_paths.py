"""The scheduler's less travelled paths, with the scripted launcher of ``test_scheduler.py``: a run cancelled or
broken in the queue, a launch Ray refuses, a worker group that dies while starting, a lost channel, a crash on a
corrupt parent checkpoint, and adopting what a dead scheduler left in every state. Each asserts the states and
the audit trail the rules (``orchestrator.policy.rules``) prescribe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.store.db import transaction
from orchestrator.store.models import AnomalyRow, Attempt, CheckpointRow, RecipeRow, Run
from tests.orchestrator.fakes import FakeLauncher, attempts, ckpt_path, load, orphan, recipe_doc, run_events, submit


def _update(factory: sessionmaker[Session], model: Any, row_id: int, **values: Any) -> None:
    with transaction(factory) as s:
        s.execute(sa.update(model).where(model.id == row_id).values(**values))


def _run_transitions(factory: sessionmaker[Session], run_id: int) -> list[tuple[str | None, str]]:
    return [(f, t) for e, f, t in run_events(factory, run_id) if e == "run"]


def _add_attempt(factory: sessionmaker[Session], run_id: int, number: int, state: str, **kw: Any) -> None:
    with transaction(factory) as s:
        s.add(Attempt(run_id=run_id, number=number, state=state, kind=kw.pop("kind", "initial"), **kw))
        run = s.get(Run, run_id)
        assert run is not None
        run.current_attempt = number


# ----------------------------------------------------------------------------------------------- the queue
def test_a_run_flagged_cancelled_in_the_queue_is_cancelled_when_claimed(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    _update(session_factory, Run, run_id, cancel_requested=True)
    make_scheduler().tick()
    run = load(session_factory, run_id)
    assert (run.state, run.reason, run.claimed_by) == ("cancelled", "cancelled before it started", None)
    assert launcher.launches == [] and attempts(session_factory, run_id) == []


def test_a_stored_recipe_that_no_longer_validates_fails_the_run_at_the_claim(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    with transaction(session_factory) as s:
        row = s.scalars(sa.select(RecipeRow)).one()
        row.parsed = {**row.parsed, "optimizer": {**row.parsed["optimizer"], "lr": -1.0}}
    make_scheduler().tick()
    run = load(session_factory, run_id)
    assert run.state == "failed" and run.reason is not None and run.reason.startswith("the stored recipe is invalid")
    assert run.claimed_by is None and launcher.launches == []
    assert _run_transitions(session_factory, run_id) == [(None, "queued"), ("queued", "starting"),
                                                         ("starting", "failed")]


def test_a_launch_ray_refuses_fails_the_run(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, monkeypatch: Any
) -> None:
    run_id = submit(session_factory)

    def refuse(**_: Any) -> None:
        raise RuntimeError("no placement group\nfor you")

    monkeypatch.setattr(launcher, "launch", refuse)
    scheduler = make_scheduler()
    scheduler.tick()
    run = load(session_factory, run_id)
    (attempt,) = attempts(session_factory, run_id)
    assert run.state == "failed" and run.reason == "attempt 1 could not start on Ray: no placement group"
    assert (attempt.state, attempt.outcome) == ("crashed", {"outcome": "crashed", "error": run.reason})
    assert run.claimed_by is None and scheduler.active_runs == []


# ------------------------------------------------------------------------------------------- worker groups
def test_a_worker_group_that_dies_while_starting_goes_back_to_the_queue(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.fit = {"state": "failed", "error": "RuntimeError: could not reach the workers"}
    scheduler.tick()  # crashed while starting: queued again (and claimed again in the same tick)
    first, second = attempts(session_factory, run_id)
    assert (first.state, first.outcome["error"]) == ("crashed", "RuntimeError: could not reach the workers")
    assert (second.kind, second.number) == ("crash_restart", 2)
    assert ("starting", "queued") in _run_transitions(session_factory, run_id)
    assert [c.launch["spec"]["attempt"] for c in launcher.of_run(run_id)] == [1, 2]
    assert load(session_factory, run_id).state == "starting"


def test_a_worker_group_that_keeps_dying_while_starting_fails_the_run(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory, recipe_doc(recovery={"max_crash_restarts": 0}))
    scheduler = make_scheduler()
    scheduler.tick()
    launcher.of_run(run_id)[0].fit = {"state": "done", "error": None}  # ended without saying how
    scheduler.tick()
    run = load(session_factory, run_id)
    assert run.state == "failed" and "crash restart budget exhausted (0/0)" in (run.reason or "")
    (attempt,) = attempts(session_factory, run_id)
    assert attempt.outcome["error"] == "the worker group exited without reporting how the attempt ended"
    assert _run_transitions(session_factory, run_id)[-1] == ("starting", "failed") and run.claimed_by is None


def test_a_lost_channel_is_a_crash_and_resumes(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.metrics(1, range(12))
    ch.checkpoint(1, 10, tmp_path / "ckpt")
    scheduler.tick()
    ch.killed = True
    scheduler.tick()
    first, second = attempts(session_factory, run_id)
    assert (first.state, first.outcome["error"]) == ("crashed", "actor died")
    assert (second.kind, second.resume_step) == ("crash_restart", 10)
    assert _run_transitions(session_factory, run_id)[-2:] == [("running", "recovering"), ("recovering", "starting")]


def test_a_crash_loading_a_corrupt_parent_marks_it_and_goes_further_back(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.metrics(1, range(25))
    for step in (10, 20):
        ch.checkpoint(1, step, tmp_path / "ckpt")
    ch.fit = {"state": "failed", "error": "RuntimeError: boom"}
    scheduler.tick()
    assert attempts(session_factory, run_id)[1].resume_step == 20
    retry = launcher.of_run(run_id)[1]
    retry.fit = {"state": "failed", "error": f"CorruptCheckpoint: corrupt checkpoint {ckpt_path(tmp_path, 20)}: "
                                             "model.pt sha256 mismatch"}
    scheduler.tick()
    third = attempts(session_factory, run_id)[2]
    assert (third.kind, third.resume_step) == ("crash_restart", 10)
    with transaction(session_factory) as s:
        rows = {r.step: r for r in s.scalars(sa.select(CheckpointRow))}
        kinds = [a.kind for a in s.scalars(sa.select(AnomalyRow))]
        assert "sha256 mismatch" in rows[20].verdict["corrupt"] and rows[20].healthy is False
    assert kinds.count("checkpoint_corrupt") == 1


# ------------------------------------------------------------------------------------------------ adoption
def _active_orphan(factory: sessionmaker[Session], state: str, **run: Any) -> int:
    run_id = submit(factory)
    _update(factory, Run, run_id, state=state, **run)
    orphan(factory, run_id)
    return run_id


def test_adopting_an_active_run_without_an_attempt_fails_it(
    session_factory: sessionmaker[Session], make_scheduler: Any
) -> None:
    run_id = _active_orphan(session_factory, "running")
    make_scheduler().tick()
    run = load(session_factory, run_id)
    assert (run.state, run.reason, run.claimed_by) == ("failed", "active run without an attempt", None)


def test_adopting_a_run_whose_attempt_succeeded_finishes_it(
    session_factory: sessionmaker[Session], make_scheduler: Any
) -> None:
    run_id = _active_orphan(session_factory, "running")
    _add_attempt(session_factory, run_id, 1, "succeeded", last_step=99,
                 outcome={"outcome": "succeeded", "final_step": 100, "onset_step": None})
    make_scheduler().tick()
    run = load(session_factory, run_id)
    assert (run.state, run.reason, run.claimed_by) == ("succeeded", "attempt 1 succeeded after 100 steps", None)


def test_adopting_a_recovering_run_whose_attempt_was_cancelled_cancels_it(
    session_factory: sessionmaker[Session], make_scheduler: Any
) -> None:
    run_id = _active_orphan(session_factory, "recovering")
    _add_attempt(session_factory, run_id, 1, "cancelled", outcome={"outcome": "cancelled", "final_step": 3})
    make_scheduler().tick()
    run = load(session_factory, run_id)
    assert (run.state, run.reason, run.claimed_by) == ("cancelled", "attempt 1 cancelled", None)


def test_adopting_a_run_whose_attempt_diverged_recovers_it(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = _active_orphan(session_factory, "running")
    _add_attempt(session_factory, run_id, 1, "diverged", onset_step=25, last_step=25,
                 outcome={"outcome": "diverged", "final_step": 25, "onset_step": 25, "detector": "loss_spike"})
    make_scheduler("sched-new").tick()
    first, second = attempts(session_factory, run_id)
    assert (second.kind, second.state, second.resume_step) == ("numeric_retry", "pending", 0)
    assert launcher.of_run(run_id)[0].launch["spec"]["attempt"] == 2
    run = load(session_factory, run_id)
    assert (run.state, run.claimed_by, run.retries_used) == ("starting", "sched-new", 1)
    assert _run_transitions(session_factory, run_id)[-2:] == [("running", "recovering"), ("recovering", "starting")]


def test_adopting_a_run_that_has_used_its_retries_fails_it(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = _active_orphan(session_factory, "recovering")
    _add_attempt(session_factory, run_id, 1, "diverged", onset_step=25,
                 outcome={"outcome": "diverged", "final_step": 25, "onset_step": 25, "detector": "loss_spike"})
    for n in (2, 3):
        _add_attempt(session_factory, run_id, n, "diverged", kind="numeric_retry", onset_step=25,
                     outcome={"outcome": "diverged", "final_step": 25, "onset_step": 25})
    make_scheduler("sched-new").tick()
    run = load(session_factory, run_id)
    assert run.state == "failed" and "numeric retry budget exhausted (2/2)" in (run.reason or "")
    assert launcher.launches == []


def test_adopting_a_starting_run_whose_attempt_ended_fails_it(
    session_factory: sessionmaker[Session], make_scheduler: Any
) -> None:
    run_id = _active_orphan(session_factory, "starting")
    _add_attempt(session_factory, run_id, 1, "crashed", outcome={"outcome": "crashed", "error": "boom"})
    make_scheduler().tick()
    run = load(session_factory, run_id)
    assert (run.state, run.reason, run.claimed_by) == ("failed", "attempt 1 ended before the run started", None)


def test_adopting_a_never_started_attempt_starts_it(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = _active_orphan(session_factory, "running")
    _add_attempt(session_factory, run_id, 1, "pending")
    make_scheduler("sched-new").tick()
    assert [c.launch["spec"]["attempt"] for c in launcher.of_run(run_id)] == [1]
    assert _run_transitions(session_factory, run_id)[-2:] == [("running", "recovering"), ("recovering", "starting")]
    assert load(session_factory, run_id).state == "starting"


def test_adopting_a_lost_worker_group_of_a_cancelled_run_cancels_it(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = _active_orphan(session_factory, "running", cancel_requested=True)
    _add_attempt(session_factory, run_id, 1, "running", ray_info={"channel": "gone"})
    make_scheduler().tick()
    run = load(session_factory, run_id)
    (attempt,) = attempts(session_factory, run_id)
    assert (run.state, run.claimed_by, attempt.state) == ("cancelled", None, "cancelled")
    assert launcher.launches == []


def test_a_crash_is_summarised_from_the_ranks_failures_when_ray_reports_them(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    run_id = submit(session_factory)
    scheduler = make_scheduler()
    scheduler.tick()
    text = "ray.train.WorkerGroupError: Training failed due to worker errors:\n[Rank 0 Error Snippet]:\nOSError: x"
    launcher.of_run(run_id)[0].fit = {"state": "failed", "error": text, "worker_failures": [
        {"rank": 0, "type": "OSError", "message": "Connection reset by peer", "died": False},
        {"rank": 1, "type": "WorkerHealthCheckFailedError", "message": "A worker health check failed.", "died": True},
    ]}
    scheduler.tick()
    first = attempts(session_factory, run_id)[0]
    assert first.outcome is not None
    assert first.outcome["error"].startswith("worker rank 1 died") and first.outcome["error_detail"] == text
