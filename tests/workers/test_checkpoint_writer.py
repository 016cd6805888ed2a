"""Checkpoints written in the background: the loop's snapshot shares nothing with the live state, a checkpoint is
registered (result, ``checkpoint`` event) only once written and verified, a write that fails or a process killed
mid-write leaves the previous checkpoint in force, and the attempt's end drains the write in flight.

No wall-clock assertions: a write is held back or failed on purpose with events and monkeypatches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from contracts.checkpoint import CorruptCheckpoint, find_checkpoints, latest_checkpoint, verify_checkpoint
from contracts.wire import AttemptSpec, SavedCheckpoint
from tests.recipes import build_recipe
from workers import checkpointing
from workers.checkpoint import load_checkpoint
from workers.checkpoint_writer import BackgroundWriter, HostStaging, to_host
from workers.checkpointing import Checkpointer
from workers.context import WorkerContext
from workers.entry import run_attempt
from workers.faults import FaultInjector
from workers.sinks import ListSink

REPO = Path(__file__).resolve().parents[2]

BASE: dict[str, Any] = {
    "name": "writer-test",
    "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 1, "n_heads": 2, "d_model": 32},
    "data": {"name": "markov", "vocab_size": 32, "seq_len": 16},
    "training": {"max_steps": 30, "batch_size": 8, "seed": 0},
    "optimizer": {"name": "adamw", "lr": 3e-3},
    "checkpoint": {"every_steps": 10, "keep": 5},
    "success": {"min_progress": 0.0, "early_min_progress": 0.0},
}
make_recipe = partial(build_recipe, BASE)


class FakeState:
    """What ``Checkpointer.save`` reads from a ``TrainingState``: a weight the test changes between saves."""

    def __init__(self) -> None:
        self.w = torch.zeros(256)

    def rank_part(self) -> dict[str, Any]:
        return {"rng": {}, "comm_hook": {}}

    @staticmethod
    def node_of(ctx: WorkerContext) -> str:
        return "here"

    def state_dict(self, per_rank: Any, progress: dict[str, Any]) -> dict[str, Any]:
        return {"model": {"w": self.w}, "progress": progress}


def checkpointer(tmp_path: Path, sink: ListSink, ctx: WorkerContext | None = None) -> Checkpointer:
    recipe = make_recipe()
    spec = AttemptSpec(recipe=recipe, checkpoint_dir=str(tmp_path / "ckpt"), run_id=1)
    return Checkpointer(spec, ctx or WorkerContext(), sink, FaultInjector(recipe.faults, attempt=1, rank=0))


def save(c: Checkpointer, state: FakeState, step: int, saved: list[SavedCheckpoint]) -> None:
    c.save(step, state, healthy=True, verdict={"loss": 1.0}, loss=1.0,  # type: ignore[arg-type]
           pending_update_ratio=None, on_saved=saved.append)


# ----------------------------------------------------------------------------------------------- snapshot
def test_the_snapshot_shares_nothing_with_the_live_state_and_keeps_tied_views_one() -> None:
    w = torch.arange(6.0)
    live = {"model": {"a": w, "tied": w.detach(), "view": w[2:4]}, "history": [1.0, {"x": torch.ones(2)}],
            "pair": (torch.zeros(1), "s"), "empty": torch.empty(0)}
    snap = to_host(live)
    with torch.no_grad():
        w.add_(100.0)
    live["history"].append(2.0)  # type: ignore[attr-defined]
    assert torch.equal(snap["model"]["a"], torch.arange(6.0)) and torch.equal(snap["model"]["view"],
                                                                              torch.tensor([2.0, 3.0]))
    assert snap["model"]["a"] is snap["model"]["tied"]  # one copy of tied weights, as torch.save would keep it
    assert snap["history"][:1] == [1.0] and len(snap["history"]) == 2 and type(snap["pair"]) is tuple
    assert snap["empty"].numel() == 0


def test_staging_reuses_its_host_buffers_from_one_checkpoint_to_the_next() -> None:
    staging = HostStaging()
    w = torch.zeros(4)
    first = staging.copy({"model": {"w": w}, "step": 1})
    with torch.no_grad():
        w.fill_(2.0)
    assert torch.equal(first["model"]["w"], torch.zeros(4))  # the loop's change does not reach the snapshot
    second = staging.copy({"model": {"w": w}, "step": 2})
    assert second["model"]["w"] is first["model"]["w"] and torch.equal(second["model"]["w"], torch.full((4,), 2.0))
    third = staging.copy({"model": {"w": torch.zeros(5)}})  # a new shape: a new buffer
    assert third["model"]["w"] is not first["model"]["w"] and third["model"]["w"].shape == (5,)


def test_one_job_in_flight_collected_in_order_with_its_exception() -> None:
    writer: BackgroundWriter[int] = BackgroundWriter()
    gate = threading.Event()
    writer.submit(lambda: gate.wait() and 1)
    assert writer.busy and not writer.done()
    with pytest.raises(RuntimeError, match="still in flight"):
        writer.submit(lambda: 2)
    gate.set()
    assert writer.collect() == 1 and not writer.busy

    def boom() -> int:
        raise OSError("disk full")

    writer.submit(boom)
    with pytest.raises(OSError, match="disk full"):
        writer.collect()
    writer.close()


# ------------------------------------------------------------------------------------------ registration
def test_a_checkpoint_is_registered_only_once_written_and_verified(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    gate, writing = threading.Event(), threading.Event()
    real_write = checkpointing.write_checkpoint

    def held(where: Any, encoded: Any) -> None:
        writing.set()
        gate.wait()
        real_write(where, encoded)

    monkeypatch.setattr(checkpointing, "write_checkpoint", held)
    sink, saved, state = ListSink(), [], FakeState()
    c = checkpointer(tmp_path, sink)
    save(c, state, 10, saved)
    with torch.no_grad():
        state.w.fill_(7.0)  # the loop goes on changing its weights while the write is held
    assert writing.wait(60)
    c.poll()
    assert saved == [] and sink.of_type("checkpoint") == [] and latest_checkpoint(tmp_path / "ckpt") is None
    gate.set()
    c.drain()
    (event,) = sink.of_type("checkpoint")
    assert [s.step for s in saved] == [10] and event["uri"] == saved[0].path
    assert set(event["timing"]) == {"stall_s", "copy_s", "write_s", "bytes"}
    loaded, manifest = load_checkpoint(event["uri"], expected_sha256=event["sha256"])
    assert manifest.step == 10 and torch.equal(loaded["model"]["w"], torch.zeros(256))  # the state at save time
    c.close()


def test_a_save_waits_for_the_previous_write_and_registers_it_first(tmp_path: Path) -> None:
    sink, saved, state = ListSink(), [], FakeState()
    c = checkpointer(tmp_path, sink)
    for step in (10, 20, 30):
        save(c, state, step, saved)
    assert [s.step for s in saved] == [10, 20]  # 30 may still be in flight; 10 and 20 were registered by a save
    c.drain()
    assert [s.step for s in saved] == [10, 20, 30] == [e["step"] for e in sink.of_type("checkpoint")]
    c.close()


def test_a_write_that_fails_midway_registers_nothing_and_leaves_the_previous_in_force(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sink, saved, state = ListSink(), [], FakeState()
    c = checkpointer(tmp_path, sink)
    save(c, state, 10, saved)
    c.drain()
    real_synced = checkpointing_module_write()

    def fails_after_first_file(path: Path, data: bytes) -> None:
        real_synced(path, data)
        if "step_00000020" in str(path):
            raise OSError("no space left on device")

    monkeypatch.setattr("workers.checkpoint._write_synced", fails_after_first_file)
    save(c, state, 20, saved)
    with pytest.raises(OSError, match="no space left"):
        c.drain()
    assert [s.step for s in saved] == [10] and [e["step"] for e in sink.of_type("checkpoint")] == [10]
    assert [m.step for _, m in find_checkpoints(tmp_path / "ckpt")] == [10]
    assert not (tmp_path / "ckpt" / "step_00000020").exists()
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_00000010"]  # the temporary dir is gone too
    verify_checkpoint(tmp_path / "ckpt" / "step_00000010", expected_sha256=saved[0].sha256)
    c.close()


def checkpointing_module_write() -> Any:
    from workers import checkpoint

    return checkpoint._write_synced


KILLED_MID_WRITE = """
import json, os, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from tests.workers.test_checkpoint_writer import make_recipe
from contracts.wire import AttemptSpec
from workers import checkpoint
from workers.entry import run_attempt

out = Path({out!r})
real = checkpoint._write_synced
def slow(path, data):
    real(path, data)
    if "step_00000020" in str(path):
        (out / "writing").touch()
        time.sleep(600)  # the parent kills this process here, mid-write
checkpoint._write_synced = slow

class FileSink:
    def emit(self, type, data):
        with open(out / "events.jsonl", "a") as fh:
            fh.write(json.dumps({{"type": type, "data": data}}) + "\\n")
    def flush(self):
        pass
    def should_stop(self):
        return False

run_attempt(AttemptSpec(recipe=make_recipe(), checkpoint_dir=str(out / "ckpt")), FileSink())
"""


@pytest.mark.timeout(300)
def test_a_process_killed_mid_write_leaves_the_previous_checkpoint_in_force(tmp_path: Path) -> None:
    script = tmp_path / "child.py"
    script.write_text(KILLED_MID_WRITE.format(repo=str(REPO), out=str(tmp_path)))
    child = subprocess.Popen([sys.executable, str(script)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        while not (tmp_path / "writing").exists():
            assert child.poll() is None, "the child ended before the step-20 write"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.wait(60)
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    registered = [e["data"] for e in events if e["type"] == "checkpoint"]
    assert [e["step"] for e in registered] == [10]  # step 20 was never announced
    assert [m.step for _, m in find_checkpoints(tmp_path / "ckpt")] == [10]
    latest = latest_checkpoint(tmp_path / "ckpt")
    assert latest is not None and latest[1].step == 10
    verify_checkpoint(tmp_path / "ckpt" / "step_00000010", expected_sha256=registered[0]["sha256"])
    leftovers = [p.name for p in (tmp_path / "ckpt").iterdir() if p.name != "step_00000010"]
    assert len(leftovers) == 1 and leftovers[0].startswith(".step_00000020.tmp-")  # hidden: no reader takes it
    with pytest.raises(CorruptCheckpoint):
        verify_checkpoint(tmp_path / "ckpt" / leftovers[0])


# ------------------------------------------------------------------------------------------------- drain
def test_the_attempt_end_lists_every_checkpoint_written_before_the_end_event(tmp_path: Path) -> None:
    sink = ListSink()
    res = run_attempt(AttemptSpec(recipe=make_recipe(), checkpoint_dir=str(tmp_path / "ckpt")), sink)
    types = [e["type"] for e in sink.events]
    assert types[-1] == "end" and types.count("checkpoint") == 3
    assert [c.step for c in res.checkpoints] == [10, 20, 30] == [e["step"] for e in sink.of_type("checkpoint")]
    for c in res.checkpoints:
        verify_checkpoint(c.path, expected_sha256=c.sha256)
    assert [t.name for t in threading.enumerate() if t.name.startswith("ballast-checkpoint-writer")] == []
