"""Run by test_engine.py in a subprocess: 2 gloo ranks (torch.multiprocessing.spawn) call ``run_attempt`` inside an
initialised process group (the engine's plain-process DDP mode). Rank 0 writes what the test checks as JSON.

Runs: fp16-compressed DDP straight; PowerSGD straight (20 steps, checkpoint at 10); PowerSGD resumed from 10;
in-place recovery: a NaN on rank 1 at step 12, rank 0's sink hands back a plan, both ranks continue as attempt 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from contracts.recipe import Recipe
from contracts.wire import AttemptSpec
from workers.entry import run_attempt
from workers.sinks import ListSink


class PlanningSink(ListSink):
    def __init__(self, resume_from: str) -> None:
        super().__init__()
        self.resume_from = resume_from

    def request_plan(self, end_data: dict[str, Any]) -> dict[str, Any] | None:
        if end_data["outcome"] != "diverged" or len(self.of_type("end")) > 1:
            return None
        return {"attempt": 2, "resume_from": self.resume_from, "overrides": {"optimizer.lr": [1e-3, 5e-4]},
                "rewarm_steps": 3, "data_offset": 0}


def recipe(compression: str, **extra: Any) -> Recipe:
    return Recipe.model_validate({**extra,
        "name": "ddp-script",
        "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 2, "n_heads": 2, "d_model": 32},
        "data": {"name": "markov", "vocab_size": 32, "seq_len": 16},
        "training": {"max_steps": 20, "batch_size": 8, "grad_accum_steps": 2, "deterministic": True},
        "schedule": {"warmup_steps": 5},
        "checkpoint": {"every_steps": 10},
        "success": {"min_progress": 0.0, "early_min_progress": 0.0},  # 20 steps: mechanics, not learning
        "resources": {"num_workers": 2},
        "distributed": {"compression": compression, "powersgd_rank": 1, "powersgd_start_iter": 3},
    })


def worker(rank: int, out: str) -> None:
    # a file rendezvous in the test's own directory: no TCP port to pick and then lose to another process
    dist.init_process_group("gloo", init_method=f"file://{Path(out) / 'rendezvous'}", rank=rank, world_size=2)
    root = Path(out)
    results: dict[str, Any] = {}
    try:
        fp16 = run_attempt(AttemptSpec(recipe=recipe("fp16"), checkpoint_dir=str(root / "fp16")))
        results["fp16"] = {"outcome": fp16.outcome, "losses": fp16.losses}
        straight = run_attempt(AttemptSpec(recipe=recipe("powersgd"), checkpoint_dir=str(root / "psgd")))
        resumed = run_attempt(AttemptSpec(recipe=recipe("powersgd"), checkpoint_dir=str(root / "psgd-resumed"),
                                          resume_from=str(root / "psgd" / "step_00000010")))
        results["powersgd"] = {"outcome": straight.outcome, "losses": straight.losses}
        results["powersgd_resumed"] = {"outcome": resumed.outcome, "losses": resumed.losses,
                                       "start_step": resumed.start_step}
        sink = PlanningSink(str(root / "inplace" / "step_00000010")) if rank == 0 else None
        faulty = recipe("none", faults=[{"type": "nan_loss", "step": 12, "rank": 1}])
        inplace = run_attempt(AttemptSpec(recipe=faulty, checkpoint_dir=str(root / "inplace")), sink)
        results["inplace"] = {"outcome": inplace.outcome, "attempt": inplace.attempt,
                              "start_step": inplace.start_step,
                              "previous": [(p.outcome, p.onset_step) for p in inplace.previous],
                              "ends": sink.of_type("end") if sink is not None else None}
    finally:
        dist.destroy_process_group()
    (root / f"results{rank}.json").write_text(json.dumps(results))
    # Leave without the interpreter's teardown: with everything written, a gloo rank process now and then dies of
    # SIGABRT ("terminate called without an active exception") while C++ objects are destroyed at exit (1 run in
    # 30 of this script on 2 loaded cores), and mp.spawn reports a rank that did its work as failed.
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1],), nprocs=2)  # type: ignore[attr-defined,no-untyped-call]
