"""A run that can never fit the cluster says so at once (``orchestrator.scheduler.claims``): it fails with the
reason, or with ``BALLAST_CLUSTER_AUTOSCALES=true`` stays queued with it; a run that only waits for free room stays
queued without one. The scripted launcher stands in for Ray here; ``test_scheduler_e2e.py`` asks the real one."""

from __future__ import annotations

from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from tests.orchestrator.fakes import FakeLauncher, attempts, load, recipe_doc, run_events, submit

NEEDS = "needs 4096 CPUs; the cluster has 2 (resources.num_workers 4096 x cpus_per_worker 1)"


def test_a_run_bigger_than_the_cluster_fails_at_once_with_the_reason(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    launcher.cpus = 2.0
    big = submit(session_factory, recipe_doc(resources={"num_workers": 4096}))
    small = submit(session_factory)
    make_scheduler().tick()
    run = load(session_factory, big)
    assert (run.state, run.reason, run.claimed_by) == ("failed", f"cannot run on this cluster: {NEEDS}", None)
    assert [(f, t) for e, f, t in run_events(session_factory, big) if e == "run"] == [
        (None, "queued"), ("queued", "starting"), ("starting", "failed")]
    assert attempts(session_factory, big) == []
    assert [c.run_id for c in launcher.launches] == [small]  # the queue behind it moves on


def test_with_an_autoscaler_it_stays_queued_with_the_reason_and_starts_once_it_fits(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher
) -> None:
    launcher.cpus = 2.0
    big = submit(session_factory, recipe_doc(resources={"num_workers": 4096}))
    scheduler = make_scheduler(cluster_autoscales=True)
    scheduler.tick()
    scheduler.tick()
    run = load(session_factory, big)
    assert (run.state, run.reason, run.claimed_by) == ("queued", f"waiting for the autoscaler: {NEEDS}", None)
    assert launcher.launches == []
    launcher.cpus = 4096.0  # the autoscaler added the nodes
    scheduler.tick()
    assert load(session_factory, big).state == "starting" and [c.run_id for c in launcher.launches] == [big]


def test_a_run_that_only_lacks_free_room_waits_without_a_reason(
    session_factory: sessionmaker[Session], make_scheduler: Any
) -> None:
    scheduler = make_scheduler()
    scheduler.ctx.launcher.cpus = 0.0  # type: ignore[attr-defined]
    scheduler.ctx.launcher.total_cpus = 8.0  # type: ignore[attr-defined]
    run_id = submit(session_factory)
    scheduler.tick()
    run = load(session_factory, run_id)
    assert (run.state, run.reason, run.claimed_by) == ("queued", None, None)
