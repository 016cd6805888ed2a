"""Run by test_own_model.py in a subprocess: 2 gloo ranks train a Hugging Face GPT-2 on dict batches from a token
file under DDP with PowerSGD, straight (16 steps, checkpoint at 8) and resumed from step 8 (the resume primes
DDP's buckets through ``Objective``); and the classifier on a TensorDataset. Rank 0 writes the results as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from contracts.recipe import validate_recipe_data
from contracts.wire import AttemptSpec
from workers.entry import run_attempt

ALLOWED = ["examples"]


def gpt2(tokens: str) -> dict[str, Any]:
    return {
        "name": "ddp-own-model",
        "model": {"name": "hf_causal_lm", "config": {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2,
                                                     "vocab_size": 64, "n_positions": 16, "bos_token_id": 0,
                                                     "eos_token_id": 0}},
        "data": {"name": "tokens_file", "path": tokens, "seq_len": 16},
        "training": {"max_steps": 16, "batch_size": 4, "grad_accum_steps": 2, "deterministic": True},
        "schedule": {"warmup_steps": 2},
        "checkpoint": {"every_steps": 8},
        "success": {"min_progress": 0.0, "early_min_progress": 0.0},
        "resources": {"num_workers": 2},
        "distributed": {"compression": "powersgd", "powersgd_rank": 1, "powersgd_start_iter": 3},
    }


def classifier() -> dict[str, Any]:
    return {
        "name": "ddp-classifier",
        "model": {"name": "custom", "factory": "examples.classifier.model:make_classifier",
                  "params": {"in_features": 8, "hidden": 16, "classes": 3}},
        "data": {"name": "dataset", "factory": "examples.classifier.model:make_dataset",
                 "params": {"n": 128, "in_features": 8, "classes": 3}},
        "loss": {"name": "cross_entropy"},
        "training": {"max_steps": 10, "batch_size": 8},
        "schedule": {"warmup_steps": 2},
        "success": {"min_progress": 0.0, "early_min_progress": 0.0},
        "resources": {"num_workers": 2},
    }


def worker(rank: int, out: str, tokens: str) -> None:
    # a file rendezvous in the test's own directory: no TCP port to pick and then lose to another process
    dist.init_process_group("gloo", init_method=f"file://{Path(out) / 'rendezvous'}", rank=rank, world_size=2)
    root = Path(out)
    results: dict[str, Any] = {}
    try:
        recipe = validate_recipe_data(gpt2(tokens))
        straight = run_attempt(AttemptSpec(recipe=recipe, checkpoint_dir=str(root / "gpt2")))
        resumed = run_attempt(AttemptSpec(recipe=recipe, checkpoint_dir=str(root / "gpt2-resumed"),
                                          resume_from=str(root / "gpt2" / "step_00000008")))
        results["straight"] = {"outcome": straight.outcome, "losses": straight.losses}
        results["resumed"] = {"outcome": resumed.outcome, "losses": resumed.losses, "start_step": resumed.start_step}
        cls = run_attempt(AttemptSpec(recipe=validate_recipe_data(classifier(), allowed_import_modules=ALLOWED),
                                      checkpoint_dir=str(root / "cls"), allowed_import_modules=ALLOWED))
        results["classifier"] = {"outcome": cls.outcome, "losses": cls.losses}
    finally:
        dist.destroy_process_group()
    (root / f"results{rank}.json").write_text(json.dumps(results))
    # Leave without the interpreter's teardown: with everything written, a gloo rank process now and then dies of
    # SIGABRT ("terminate called without an active exception") while C++ objects are destroyed at exit (1 run in
    # 30 of this script on 2 loaded cores), and mp.spawn reports a rank that did its work as failed.
    os._exit(0)


if __name__ == "__main__":
    mp.spawn(worker, args=(sys.argv[1], sys.argv[2]), nprocs=2)  # type: ignore[attr-defined,no-untyped-call]
