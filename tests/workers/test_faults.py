"""Fault injection: each fault fires only at its step, in its attempt, on its rank."""

from __future__ import annotations

import math
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from contracts.recipe import (
    BatchScaleFault,
    CorruptCheckpointFault,
    GradScaleFault,
    HangFault,
    NanLossFault,
)
from workers.faults import FaultInjector, InjectedCrash


def test_nan_loss_only_at_its_step_and_attempt() -> None:
    inj = FaultInjector([NanLossFault(step=3)], attempt=1, rank=0)
    loss = torch.tensor(2.0, requires_grad=True)
    out = inj.on_loss(3, loss)
    assert math.isnan(float(out.detach()))
    out.backward()  # type: ignore[no-untyped-call]
    assert loss.grad is not None and math.isnan(float(loss.grad))  # the NaN reaches the gradients
    assert float(inj.on_loss(2, loss).detach()) == 2.0
    other_attempt = FaultInjector([NanLossFault(step=3)], attempt=2, rank=0)
    assert float(other_attempt.on_loss(3, loss).detach()) == 2.0


def test_grad_scale_on_named_rank_only() -> None:
    faults = [GradScaleFault(step=1, factor=1e4, rank=1)]
    for rank, expected in ((0, 1.0), (1, 1e4)):
        p = torch.nn.Parameter(torch.zeros(3))
        p.grad = torch.ones(3)
        FaultInjector(faults, attempt=1, rank=rank).on_grads(1, [p])
        assert torch.all(p.grad == expected)


def test_batch_scale_float_inputs_and_token_loss() -> None:
    inj = FaultInjector([BatchScaleFault(step=0, factor=10.0)], attempt=1, rank=0)
    x, y = inj.on_batch(0, (torch.ones(2, 3), torch.zeros(2, 1)))
    assert torch.all(x == 10.0)
    tokens = torch.zeros(2, 4, dtype=torch.long)
    assert inj.on_batch(0, (tokens, tokens))[0] is tokens
    assert float(inj.on_loss(0, torch.tensor(1.5), tokens)) == 15.0
    assert float(inj.on_loss(0, torch.tensor(1.5), torch.ones(2, 3))) == 1.5  # float data: scaled via inputs


def test_corrupt_checkpoint_damages_state_file_then_crashes(tmp_path: Path) -> None:
    ckpt = tmp_path / "step_00000010"
    ckpt.mkdir()
    state = ckpt / "state.pt"
    state.write_bytes(bytes(range(256)) * 8)
    (ckpt / "manifest.json").write_text("{}")
    before = state.read_bytes()
    inj = FaultInjector([CorruptCheckpointFault(step=5)], attempt=1, rank=0)
    with pytest.raises(InjectedCrash):
        inj.after_checkpoint(10, ckpt)
    assert state.read_bytes() != before
    assert (ckpt / "manifest.json").read_text() == "{}"
    inj.after_checkpoint(20, ckpt)  # fires once


@pytest.mark.slow
def test_kill_worker_sigkills_the_process() -> None:
    code = (
        "from contracts.recipe import KillWorkerFault\n"
        "from workers.faults import FaultInjector\n"
        "inj = FaultInjector([KillWorkerFault(step=2)], attempt=1, rank=0)\n"
        "inj.before_step(0); inj.before_step(1); inj.before_step(2)\n"
        "print('survived')\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    assert "survived" not in proc.stdout


class _Slept(Exception):
    pass


def test_hang_sleeps_forever_on_its_rank_at_its_step_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import workers.faults as faults_mod

    naps: list[float] = []

    class NoSleep:
        @staticmethod
        def sleep(seconds: float) -> None:
            naps.append(seconds)
            if len(naps) == 3:  # it would go on forever
                raise _Slept

    monkeypatch.setattr(faults_mod, "time", NoSleep)
    inj = FaultInjector([HangFault(step=4, rank=1)], attempt=1, rank=1)
    inj.before_step(3)
    assert naps == []
    with pytest.raises(_Slept):
        inj.before_step(4)
    assert len(naps) == 3
    FaultInjector([HangFault(step=4, rank=1)], attempt=1, rank=0).before_step(4)  # another rank goes on
    FaultInjector([HangFault(step=4, rank=1)], attempt=2, rank=1).before_step(4)  # and so does the retry
    assert len(naps) == 3
