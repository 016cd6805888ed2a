"""kill -9 of the control plane: `ballast serve` (API, scheduler and its local Ray in one process group) is
SIGKILLed mid-run, then started again on the same home. The run must resume from the newest valid checkpoint on
storage — also one the store never heard of, because its event was still in the channel that died with Ray — and
finish, with no checkpoint directory left on storage that no live row names.

The first server drains its channels only every few seconds (``BALLAST_SCHEDULER_POLL_SECONDS``), so at the kill
checkpoints written since the last drain are likely on storage only; the test measures that gap at the kill and
asserts on whatever it is (the resumption point is asserted either way).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
import yaml
from sqlalchemy.orm import Session, sessionmaker

from api.client import BallastClient
from contracts.checkpoint import CorruptCheckpoint, verify_checkpoint
from orchestrator.store.db import make_engine, make_session_factory, transaction
from orchestrator.store.models import Attempt, CheckpointRow, MetricPoint, Run
from tests.api.test_cli import BALLAST, _serve_env, _wait_healthy
from tests.ports import free_port
from tests.recipes import recipe_doc

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]

KEEP = 3
MAX_STEPS = 2000
"""Long enough that the run cannot end within the first server's first drains: checkpoints are written in the
background now, so a tiny model runs hundreds of steps a second."""
RECIPE = recipe_doc(
    {"name": "survives-kill-9",
     "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 1, "n_heads": 2, "d_model": 32},
     "data": {"name": "markov", "vocab_size": 32, "seq_len": 16},
     "training": {"max_steps": MAX_STEPS, "batch_size": 8, "seed": 3},
     "optimizer": {"name": "adamw", "lr": 0.003},
     "schedule": {"warmup_steps": 5, "decay": "constant"},
     "checkpoint": {"every_steps": 5, "keep": KEEP}},
)
DEADLINE_S = 600.0  # generous (a shared machine); nothing asserts on time


def _start(home: Path, port: int, log: Path, poll_s: str) -> subprocess.Popen[str]:
    env = _serve_env(home, BALLAST_RAY_NUM_CPUS="2", BALLAST_SCHEDULER_POLL_SECONDS=poll_s)
    env.pop("RAY_ADDRESS", None)  # its own local Ray, which dies with it: the case being tested
    with log.open("a") as out:
        return subprocess.Popen([*BALLAST, "serve", "--port", str(port), "--log-level", "warning"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _kill_group(proc: subprocess.Popen[str], sig: int = signal.SIGKILL) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(60)


def _valid_steps(group: Path) -> dict[int, str]:
    """The valid checkpoints on storage (manifest and every file verified): step → directory."""
    out: dict[int, str] = {}
    for child in sorted(group.glob("step_*")):
        try:
            out[verify_checkpoint(child).step] = str(child)
        except CorruptCheckpoint:
            continue
    return out


def _settled_listing(group: Path) -> dict[int, str]:
    """Storage once the killed group's processes are gone (a worker may outlive the raylet by a moment)."""
    previous: dict[int, str] | None = None
    stop_at = time.monotonic() + 60
    while time.monotonic() < stop_at:
        now = _valid_steps(group)
        if now == previous:
            return now
        previous = now
        time.sleep(2.0)
    raise AssertionError(f"checkpoint storage kept changing after the kill: {sorted(previous or {})}")


def _a_gap_is_likely(factory: sessionmaker[Session], group: Path, run_id: int) -> bool:
    """Mid-run, with the store knowing some checkpoints and storage holding at least two newer ones (the drain
    may still catch up before the kill lands: the test measures the gap after it)."""
    with transaction(factory) as s:
        known = list(s.scalars(sa.select(CheckpointRow.step).where(CheckpointRow.run_id == run_id)))
    if not known:
        return False
    return sum(1 for step in _valid_steps(group) if step > max(known)) >= 2


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Path, sa.Engine]]:
    home = tmp_path / "home"
    home.mkdir()
    engine = make_engine(f"sqlite:///{home / 'ballast.db'}")
    yield home, engine
    engine.dispose()


def test_a_sigkilled_control_plane_resumes_from_the_newest_checkpoint_on_storage_and_leaves_no_orphans(
    store: tuple[Path, sa.Engine], tmp_path: Path
) -> None:
    home, engine = store
    factory = make_session_factory(engine)
    log = tmp_path / "serve.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    group = home / "checkpoints" / "run-1-attempt-1"

    first = _start(home, port, log, poll_s="3")
    try:
        _wait_healthy(url, first, timeout=240)
        with BallastClient(url) as client:
            run_id = int(client.submit_run(yaml.safe_dump(RECIPE)).run["id"])
        assert run_id == 1
        stop_at = time.monotonic() + DEADLINE_S
        while not _a_gap_is_likely(factory, group, run_id):
            assert time.monotonic() < stop_at and first.poll() is None, log.read_text()[-3000:]
            with transaction(factory) as s:
                ended = s.scalar(sa.select(Run.state).where(Run.id == run_id)) in ("succeeded", "failed")
            assert not ended, "the run ended before the kill: nothing left to resume (the machine was too slow?)"
            time.sleep(0.1)
    finally:
        _kill_group(first)  # kill -9 of the whole control plane, its local Ray included

    on_storage = _settled_listing(group)
    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None and run.state == "running", log.read_text()[-3000:]  # left behind, mid-run
        known = set(s.scalars(sa.select(CheckpointRow.step).where(CheckpointRow.run_id == run_id)))
    newest = max(on_storage)
    gap = sorted(set(on_storage) - known)  # on storage, not in the store: their events died with the channel
    assert newest < MAX_STEPS
    print(f"at the kill: newest valid on storage {newest}, store knew {sorted(known)}, gap {gap}")  # for -s / -rA

    second = _start(home, port, log, poll_s="0.5")
    try:
        _wait_healthy(url, second, timeout=240)
        stop_at = time.monotonic() + DEADLINE_S
        while True:
            with transaction(factory) as s:
                state = s.scalar(sa.select(Run.state).where(Run.id == run_id))
            if state in ("succeeded", "failed", "cancelled"):
                break
            assert time.monotonic() < stop_at and second.poll() is None, log.read_text()[-3000:]
            time.sleep(0.5)
    finally:
        _kill_group(second, signal.SIGTERM)

    diag = f"gap {gap}, newest on storage {newest}, store knew {sorted(known)}\n{log.read_text()[-3000:]}"
    with transaction(factory) as s:
        attempts = list(s.scalars(sa.select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)))
        rows = list(s.scalars(sa.select(CheckpointRow).where(CheckpointRow.run_id == run_id)))
        resumed_steps = list(s.scalars(sa.select(MetricPoint.step).where(MetricPoint.attempt_id == attempts[-1].id)
                                       .order_by(MetricPoint.step)))
        state = s.scalar(sa.select(Run.state).where(Run.id == run_id))
    assert state == "succeeded", diag
    crashed, resumed = attempts
    assert crashed.state == "crashed" and "lost while the control plane was down" in crashed.outcome["error"], diag
    # at most the steps since the newest checkpoint on storage are recomputed
    assert (resumed.kind, resumed.resume_step) == ("crash_restart", newest), diag
    assert resumed_steps[0] == newest, diag
    by_step = {r.step: r for r in rows if r.attempt_id == crashed.id}
    assert set(gap) <= set(by_step), diag  # what the store had missed was registered from storage
    assert by_step[newest].uri == on_storage[newest] and resumed.parent_checkpoint_id == by_step[newest].id
    # no orphans: storage holds exactly the checkpoints the store keeps (retention: keep K + the newest healthy)
    live = {r.uri for r in rows if not r.deleted}
    left = {str(p) for p in (home / "checkpoints").glob("run-*/step_*")}
    assert left == live, diag
    assert len(live) <= KEEP + 1, diag
