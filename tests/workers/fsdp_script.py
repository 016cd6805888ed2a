"""Run by test_sharding.py in a subprocess: 2 gloo ranks (torch.multiprocessing.spawn) run FSDP attempts
(``distributed.strategy: fsdp``) inside an initialised process group. Each rank writes what the test checks as JSON.

Runs: the clipping methods on a sharded model against an unsharded replica (same batch on both ranks); FSDP
straight (20 steps, sharded checkpoints at 10 and 20); resumed from 10 at the same world size; in-place recovery: a
NaN on rank 1 at step 12, rank 0's sink hands back a plan, both ranks continue as attempt 2 from step 10; FSDP with
a frozen block, activation checkpointing, adaptive clipping and bf16 autocast together. The test
then resumes the world-size-2 checkpoint at world size 1 in its own process.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from contracts.recipe import Clipping, Recipe
from contracts.wire import AttemptSpec
from workers.clipping import Clipper, grad_norms, param_snapshot, update_ratio
from workers.entry import run_attempt
from workers.models import build_model
from workers.objective import Objective
from workers.sharding import local, shard_model
from workers.sinks import ListSink

MODEL = {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 2, "n_heads": 2, "d_model": 32}
DATA = {"name": "markov", "vocab_size": 32, "seq_len": 16}


class PlanningSink(ListSink):
    def __init__(self, resume_from: str) -> None:
        super().__init__()
        self.resume_from = resume_from

    def request_plan(self, end_data: dict[str, Any]) -> dict[str, Any] | None:
        if end_data["outcome"] != "diverged" or len(self.of_type("end")) > 1:
            return None
        return {"attempt": 2, "resume_from": self.resume_from, "overrides": {"optimizer.lr": [1e-3, 5e-4]},
                "rewarm_steps": 3, "data_offset": 0}


def recipe(strategy: str = "fsdp", **extra: Any) -> Recipe:
    return Recipe.model_validate({
        "name": "fsdp-script",
        "model": MODEL,
        "data": DATA,
        "training": {"max_steps": 20, "batch_size": 8, "grad_accum_steps": 2, "deterministic": True},
        "schedule": {"warmup_steps": 5},
        "checkpoint": {"every_steps": 10},
        "telemetry": {"layer_stats_every": 5},
        "success": {"min_progress": 0.0, "early_min_progress": 0.0},  # 20 steps: mechanics, not learning
        "resources": {"num_workers": 2},
        "distributed": {"strategy": strategy},
        **extra,
    })


def clipping_on_shards(rank: int) -> dict[str, Any]:
    """Each clipping method on the sharded model vs an unsharded replica fed the same batch: the per-tensor norms,
    the post-clip norm and the clipped gradients (gathered) must agree; so must the update ratio of one step."""
    r = recipe()
    out: dict[str, Any] = {}
    for method in ("global_norm", "per_layer", "adaptive"):
        cfg = Clipping(method=method, max_norm=0.05)
        from workers.data import build_data

        data = build_data(r.data, seed=0, batch_size=8, rank=0, world_size=1)
        replica = build_model(r.model, data, seed=0)
        sharded = shard_model(copy.deepcopy(replica), torch.device("cpu"))
        batch = data.batch(0)
        results = []
        for model in (replica, sharded):
            Objective(model, r.loss).loss(batch, model=model).backward()  # type: ignore[no-untyped-call]
            named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            params = [p for _, p in named]
            norms = grad_norms(params)
            post = Clipper(cfg, named).clip(norms)
            grads = [p.grad.full_tensor() if model is sharded else p.grad for p in params]  # type: ignore[union-attr]
            before = param_snapshot(params)
            with torch.no_grad():
                for p in params:
                    local(p).sub_(0.1 * local(p.grad))  # type: ignore[arg-type]
            results.append((norms, post, grads, update_ratio(before, params)))
        (n0, p0, g0, u0), (n1, p1, g1, u1) = results
        out[method] = {
            "norms": torch.allclose(n0, n1, rtol=1e-5, atol=1e-7),
            "post": torch.allclose(p0, p1, rtol=1e-5, atol=1e-7),
            "grads": all(torch.allclose(a, b, rtol=1e-5, atol=1e-7) for a, b in zip(g0, g1, strict=True)),
            "ratio": torch.allclose(u0, u1, rtol=1e-5, atol=1e-7),
            "clipped": float(p0) < float(n0.square().sum().sqrt()),
        }
    return out


def worker(rank: int, out: str) -> None:
    # a file rendezvous in the test's own directory: no TCP port to pick and then lose to another process
    dist.init_process_group("gloo", init_method=f"file://{Path(out) / 'rendezvous'}", rank=rank, world_size=2)
    root = Path(out)
    results: dict[str, Any] = {}
    try:
        results["clipping"] = clipping_on_shards(rank)
        combo = recipe(clipping={"method": "adaptive"}, precision={"dtype": "bf16"},
                       distributed={"strategy": "fsdp", "freeze_first_n_blocks": 1, "activation_checkpointing": True})
        combined = run_attempt(AttemptSpec(recipe=combo, checkpoint_dir=str(root / "combined")))
        results["combined"] = {"outcome": combined.outcome, "losses": combined.losses}
        straight = run_attempt(AttemptSpec(recipe=recipe(), checkpoint_dir=str(root / "straight")))
        resumed = run_attempt(AttemptSpec(recipe=recipe(), checkpoint_dir=str(root / "resumed"),
                                          resume_from=str(root / "straight" / "step_00000010")))
        results["straight"] = {"outcome": straight.outcome, "losses": straight.losses,
                               "grad_norms": straight.grad_norms}
        results["resumed"] = {"outcome": resumed.outcome, "losses": resumed.losses, "start_step": resumed.start_step,
                              "grad_norms": resumed.grad_norms}
        sink = PlanningSink(str(root / "inplace" / "step_00000010")) if rank == 0 else None
        faulty = recipe(faults=[{"type": "nan_loss", "step": 12, "rank": 1}])
        inplace = run_attempt(AttemptSpec(recipe=faulty, checkpoint_dir=str(root / "inplace")), sink)
        results["inplace"] = {"outcome": inplace.outcome, "attempt": inplace.attempt,
                              "start_step": inplace.start_step, "final_step": inplace.final_step,
                              "previous": [(p.outcome, p.onset_step) for p in inplace.previous],
                              "ends": sink.of_type("end") if sink is not None else None,
                              "layer_stats": len(sink.of_type("layer_stats")) if sink is not None else None}
    finally:
        dist.destroy_process_group()
    (root / f"results{rank}.json").write_text(json.dumps(results))
    # Leave without the interpreter's teardown: with everything written, a gloo rank process now and then dies of
    # SIGABRT ("terminate called without an active exception") while C++ objects are destroyed at exit (1 run in
    # 30 of this script on 2 loaded cores), and mp.spawn reports a rank that did its work as failed.
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1],), nprocs=2)  # type: ignore[attr-defined,no-untyped-call]
