"""Run by test_eval.py in a subprocess: 2 gloo ranks call ``run_attempt`` with held-out eval on and off. Each rank
writes its evals and losses as JSON (results{rank}.json), so the test can check that every rank holds the same
eval losses (the all-gathered mean), that nothing deadlocks, and that eval leaves the trajectory unchanged."""

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


def recipe(eval_interval: int) -> Recipe:
    return Recipe.model_validate({
        "name": "ddp-eval",
        "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 2, "n_heads": 2, "d_model": 32},
        "data": {"name": "markov", "vocab_size": 32, "seq_len": 16},
        "training": {"max_steps": 12, "batch_size": 8, "deterministic": True, "eval_interval": eval_interval,
                     "eval_batches": 2},
        "schedule": {"warmup_steps": 3},
        "checkpoint": {"every_steps": 6},
        "success": {"min_progress": 0.0, "early_min_progress": 0.0},
        "resources": {"num_workers": 2},
    })


def worker(rank: int, out: str) -> None:
    # a file rendezvous in the test's own directory: no TCP port to pick and then lose to another process
    dist.init_process_group("gloo", init_method=f"file://{Path(out) / 'rendezvous'}", rank=rank, world_size=2)
    root = Path(out)
    results: dict[str, Any] = {}
    try:
        sink = ListSink() if rank == 0 else None
        on = run_attempt(AttemptSpec(recipe=recipe(5), checkpoint_dir=str(root / "on")), sink)
        off = run_attempt(AttemptSpec(recipe=recipe(0), checkpoint_dir=str(root / "off")))
        results = {"on": {"outcome": on.outcome, "losses": on.losses, "evals": on.evals,
                          "checkpoints": sink.of_type("checkpoint") if sink is not None else None},
                   "off": {"outcome": off.outcome, "losses": off.losses}}
    finally:
        dist.destroy_process_group()
    (root / f"results{rank}.json").write_text(json.dumps(results))
    # Leave without the interpreter's teardown: with everything written, a gloo rank process now and then dies of
    # SIGABRT ("terminate called without an active exception") while C++ objects are destroyed at exit (1 run in
    # 30 of this script on 2 loaded cores), and mp.spawn reports a rank that did its work as failed.
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1],), nprocs=2)  # type: ignore[attr-defined,no-untyped-call]
