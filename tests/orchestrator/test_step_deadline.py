"""The step-progress deadline (``resources.step_timeout_s``), with the scripted launcher and the scheduler's
monotonic clock moved by hand (no waiting): an attempt whose events stop for longer is crashed with "no step for N
s (hung?)", its worker group torn down and resumed by the crash path; events keep it alive; a group still starting
up (no event yet) is not judged by it. The real hang (a rank of a 2-worker gloo group that sleeps forever) is in
``test_scheduler_e2e.py``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

import orchestrator.scheduler.service as service_mod
from contracts.recipe import RecipeError, validate_recipe_data
from orchestrator.channel import collective_timeout_s, step_timeout_of
from tests.orchestrator.fakes import FakeLauncher, attempts, load, orphan, recipe_doc, submit


class Clock:
    """Stands in for the ``time`` module inside the service: ``monotonic`` is moved by ``advance``."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(service_mod, "time", c)
    return c


def test_an_attempt_without_a_step_for_the_deadline_is_crashed_torn_down_and_resumed(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path,
    clock: Clock
) -> None:
    run_id = submit(session_factory, recipe_doc(resources={"step_timeout_s": 30}))
    scheduler = make_scheduler()
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.metrics(1, range(12))
    ch.checkpoint(1, 10, tmp_path / "ckpt")
    scheduler.tick()
    for _ in range(3):  # events keep coming: alive however long the run takes
        clock.advance(25)
        ch.metrics(1, range(12, 13))
        scheduler.tick()
    clock.advance(29)
    scheduler.tick()
    assert attempts(session_factory, run_id)[0].state == "running"  # within the deadline

    clock.advance(2)
    scheduler.tick()
    hung, resumed = attempts(session_factory, run_id)
    assert hung.state == "crashed" and hung.outcome["error"] == "no step for 30 s (hung?); last step 12"
    assert ch.killed  # the worker group is torn down
    assert (resumed.kind, resumed.resume_step, resumed.overrides) == ("crash_restart", 10, {})  # no tightening
    assert launcher.of_run(run_id)[1].launch["spec"]["attempt"] == 2
    run = load(session_factory, run_id)
    assert (run.crash_restarts_used, run.retries_used) == (1, 0)


def test_a_group_still_starting_up_is_not_judged_by_the_step_deadline(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, clock: Clock
) -> None:
    run_id = submit(session_factory, recipe_doc(resources={"step_timeout_s": 5}))
    scheduler = make_scheduler()
    scheduler.tick()
    clock.advance(3600)
    scheduler.tick()
    assert [a.state for a in attempts(session_factory, run_id)] == ["pending"]
    assert not launcher.of_run(run_id)[0].killed


def test_the_deadline_is_validated_and_sets_the_collective_timeout() -> None:
    assert validate_recipe_data(recipe_doc()).resources.step_timeout_s == 600.0
    for bad in (0, 0.5, -1, True, "10", 10**6):
        with pytest.raises(RecipeError):
            validate_recipe_data(recipe_doc(resources={"step_timeout_s": bad}))
    # the backstop outlasts the deadline, so the scheduler names the hang first
    assert collective_timeout_s(10) == 70 and collective_timeout_s(600) == 1200
    spec = {"spec": {"recipe": {"resources": {"step_timeout_s": 42.0}}}}
    assert step_timeout_of(spec) == 42.0 and step_timeout_of({"spec": {}}) == 600.0


def test_a_group_that_hung_while_the_scheduler_was_away_is_judged_from_the_reattachment(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, clock: Clock,
    monkeypatch: pytest.MonkeyPatch
) -> None:
    import orchestrator.scheduler.adoption as adoption_mod

    monkeypatch.setattr(adoption_mod, "time", clock)
    run_id = submit(session_factory, recipe_doc(resources={"step_timeout_s": 30}))
    first = make_scheduler("sched-a")
    first.tick()
    ch = launcher.of_run(run_id)[0]
    ch.metrics(1, range(3))
    first.tick()  # running; then its scheduler died, and the group stopped making progress
    assert attempts(session_factory, run_id)[0].state == "running"
    orphan(session_factory, run_id)
    successor = make_scheduler("sched-b")
    successor.tick()  # reattached: no event ever comes again
    clock.advance(29)
    successor.tick()
    assert attempts(session_factory, run_id)[0].state == "running"
    clock.advance(2)
    successor.tick()
    assert attempts(session_factory, run_id)[0].state == "crashed" and ch.killed
