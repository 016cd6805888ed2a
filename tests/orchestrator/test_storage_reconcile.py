"""Checkpoint storage reconciled with the store once a worker group is over (``orchestrator/scheduler/storage.py``),
with the scripted launcher: checkpoints on storage that the store never heard of (their events died with the
channel) are registered from their manifests and resumed from; incomplete or damaged directories and directories
of deleted rows are removed; retention then leaves exactly what it keeps."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import sqlalchemy as sa
import torch
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.store.db import transaction
from orchestrator.store.models import CheckpointRow
from tests.orchestrator.fakes import FakeChannel, FakeLauncher, attempts, orphan, submit
from workers.checkpoint import save_checkpoint


def group_dir(tmp_path: Path, run_id: int, attempt: int = 1) -> Path:
    """Where a worker group's checkpoints go: ``<checkpoint root>/run-<id>-attempt-<n>`` (the launch's prefix)."""
    return tmp_path / "ckpt" / f"run-{run_id}-attempt-{attempt}"


def write(tmp_path: Path, run_id: int, step: int, *, attempt: int = 1, healthy: bool = True,
          loss: float = 1.5) -> tuple[str, str]:
    """A checkpoint as the engine writes it under Ray Train (meta: step, health, verdict, attempt, run);
    returns (uri, sha256)."""
    verdict = {"weights_finite": True, "loss_in_bounds": healthy, "loss": loss, "smoothed_loss": loss}
    info = save_checkpoint(group_dir(tmp_path, run_id, attempt) / f"step_{step:08d}", {"model": {"w": torch.ones(2)}},
                           meta={"step": step, "healthy": healthy, "verdict": verdict, "attempt": attempt,
                                 "run_id": run_id})
    return str(info.path), info.sha256


def announce(ch: FakeChannel, tmp_path: Path, run_id: int, step: int, **kw: Any) -> str:
    """Written and announced through the channel (the normal path)."""
    uri, sha = write(tmp_path, run_id, step, **kw)
    ch.emit(1, "checkpoint", {"step": step, "uri": uri, "sha256": sha, "healthy": kw.get("healthy", True),
                              "verdict": {"weights_finite": True}, "metrics": {}})
    return uri


def rows(factory: sessionmaker[Session], run_id: int) -> dict[int, CheckpointRow]:
    with transaction(factory) as s:
        return {r.step: r for r in s.scalars(sa.select(CheckpointRow).where(CheckpointRow.run_id == run_id))}


def on_disk(tmp_path: Path, run_id: int) -> set[str]:
    return {str(p) for p in group_dir(tmp_path, run_id).glob("step_*")}


def _running_with_a_gap(factory: sessionmaker[Session], scheduler: Any, launcher: FakeLauncher,
                        tmp_path: Path) -> tuple[int, FakeChannel]:
    """Steps 0..44 ran; checkpoints 10 and 20 reached the store, 30 and 40 only storage, 45's save never
    finished (no manifest), and 35 was damaged."""
    run_id = submit(factory)
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.metrics(1, range(22))
    for step in (10, 20):
        announce(ch, tmp_path, run_id, step)
    scheduler.tick()
    for step in (30, 40):
        write(tmp_path, run_id, step, healthy=step == 30, loss=1.2)
    damaged, _ = write(tmp_path, run_id, 35)
    (Path(damaged) / "model.pt").write_bytes(b"garbage")
    (group_dir(tmp_path, run_id) / "step_00000045").mkdir()
    (group_dir(tmp_path, run_id) / "step_00000045" / "model.pt").write_bytes(b"half")
    return run_id, ch


def test_a_group_lost_while_the_control_plane_was_down_resumes_from_the_newest_checkpoint_on_storage(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    first = make_scheduler("sched-a")
    run_id, ch = _running_with_a_gap(session_factory, first, launcher, tmp_path)
    ch.killed = True  # the control plane died and its local Ray with it: the channel and its events are gone
    orphan(session_factory, run_id)
    make_scheduler("sched-b").tick()

    crashed, resumed = attempts(session_factory, run_id)
    assert crashed.state == "crashed" and "lost while the control plane was down" in crashed.outcome["error"]
    assert (resumed.kind, resumed.state, resumed.resume_step) == ("crash_restart", "pending", 40)
    assert "resumed from step 40" in (resumed.reason or "")
    stored = rows(session_factory, run_id)
    assert set(stored) == {10, 20, 30, 40}  # 35 (damaged) and 45 (unfinished) were never checkpoints
    assert resumed.parent_checkpoint_id == stored[40].id
    # health, verdict and loss come from the manifest, as the checkpoint event would have carried them
    assert (stored[30].healthy, stored[40].healthy) == (True, False)
    assert stored[40].verdict["loss_in_bounds"] is False and stored[40].metrics["smoothed_loss"] == 1.2
    assert stored[40].uri == str(group_dir(tmp_path, run_id) / "step_00000040")
    # retention (keep 2, plus the newest healthy): 10 and 20 deleted; nothing on storage that no live row names
    assert {s for s, r in stored.items() if r.deleted} == {10, 20}
    assert on_disk(tmp_path, run_id) == {r.uri for r in stored.values() if not r.deleted}
    assert crashed.last_step == 40


def test_a_channel_lost_under_a_live_scheduler_registers_what_it_missed_too(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    scheduler = make_scheduler()
    run_id, ch = _running_with_a_gap(session_factory, scheduler, launcher, tmp_path)
    ch.killed = True
    scheduler.tick()
    crashed, resumed = attempts(session_factory, run_id)
    assert (crashed.state, resumed.kind, resumed.resume_step) == ("crashed", "crash_restart", 40)
    stored = rows(session_factory, run_id)
    assert on_disk(tmp_path, run_id) == {r.uri for r in stored.values() if not r.deleted}


def test_directories_of_deleted_rows_are_removed_and_foreign_ones_left_alone(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    scheduler = make_scheduler()
    run_id = submit(session_factory)
    scheduler.tick()
    ch = launcher.of_run(run_id)[0]
    ch.metrics(1, range(12))
    kept = announce(ch, tmp_path, run_id, 10)
    scheduler.tick()
    # retention had marked a row deleted, but the scheduler died before removing its directory
    left_over, sha = write(tmp_path, run_id, 5)
    with transaction(session_factory) as s:
        attempt_id = s.scalars(sa.select(CheckpointRow.attempt_id)).one()
        s.add(CheckpointRow(run_id=run_id, attempt_id=attempt_id, step=5, uri=left_over, sha256=sha, healthy=True,
                            verdict={}, metrics={}, deleted=True))
    foreign, _ = write(tmp_path, run_id + 1, 7)  # another run's checkpoint in this directory: not ours to judge
    Path(foreign).rename(group_dir(tmp_path, run_id) / "step_00000007")
    ch.fit = {"state": "failed", "error": "RuntimeError: boom"}
    scheduler.tick()
    assert not Path(left_over).exists() and Path(kept).exists()
    assert (group_dir(tmp_path, run_id) / "step_00000007").exists()
    assert set(rows(session_factory, run_id)) == {5, 10}
    assert attempts(session_factory, run_id)[1].resume_step == 10


def test_an_attempt_whose_events_never_reached_the_store_but_whose_checkpoints_did_is_resumed_not_restarted(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    run_id = submit(session_factory)
    make_scheduler("sched-a").tick()  # launched; the first drain never came
    for step in (10, 20):
        write(tmp_path, run_id, step)
    launcher.of_run(run_id)[0].killed = True
    orphan(session_factory, run_id)
    make_scheduler("sched-b").tick()
    ran, resumed = attempts(session_factory, run_id)
    assert ran.state == "crashed" and ran.started_at is not None
    assert (resumed.kind, resumed.resume_step) == ("crash_restart", 20)
    assert set(rows(session_factory, run_id)) == {10, 20}
