"""Fresh scenarios: unstable runs written outside both halves, as a new user would write them, for a quick look
at divergences the benchmark does not hold. Each runs in this process through the ``ballast train`` loop
(``api.cli.local_run.LocalRun``: the same policy and verdict as the service, one torch thread like a service
worker), under ``none`` and ``ballast``, beside its reference (the same model and data at a safe LR).

``python -m benchmarks.divergence.fresh [NAME ...]`` prints one JSON line per scenario: outcome, final ÷ reference
(mean of the last 20 steps of the lineage's curve), steps executed ÷ max_steps and every attempt's changes.
A scenario that has been looked at is no longer fresh: BENCHMARKS.md says which were used to change what.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from api.cli.local_run import LocalRun
from api.cli.train_cmd import run_in_process
from benchmarks.divergence.cases import deep_merge
from benchmarks.divergence.metrics import final_loss, steps_executed
from contracts.recipe import Recipe
from contracts.wire import AttemptSpec
from workers.sinks import ListSink

MARKOV = {"name": "markov", "vocab_size": 32, "seq_len": 16}


def _gpt(d_model: int = 64, **extra: Any) -> dict[str, Any]:
    return {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 2, "n_heads": 2, "d_model": d_model,
            **extra}


def _recipe(model: dict[str, Any], data: dict[str, Any], optimizer: dict[str, Any], *, warmup: int = 0,
            clipping: dict[str, Any] | None = None, dtype: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "fresh", "model": model, "data": data,
        "training": {"max_steps": 150, "batch_size": 16, "seed": 7},
        "optimizer": optimizer, "schedule": {"warmup_steps": warmup, "decay": "cosine"},
        "checkpoint": {"every_steps": 25}, "faults": [],
    }
    if clipping is not None:
        doc["clipping"] = clipping
    if dtype is not None:
        doc["precision"] = {"dtype": dtype}
    return doc


NO_CLIP = {"method": "none"}
SCENARIOS: dict[str, tuple[dict[str, Any], float]] = {
    # name: (unstable recipe, the reference's LR)
    "postln-adam": (_recipe(_gpt(norm_position="post"), MARKOV, {"name": "adam", "lr": 0.03}), 0.002),
    "gpt-sgd-momentum": (_recipe(_gpt(32), MARKOV, {"name": "sgd", "lr": 3.0, "momentum": 0.9}, clipping=NO_CLIP),
                         0.3),
    "gpt-wide-init": (_recipe(_gpt(init_std=0.3), MARKOV, {"name": "adamw", "lr": 0.01}), 0.001),
    "gpt-bf16-warmup20": (_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.06}, warmup=20, dtype="bf16"), 0.003),
    "mlp-relu-adam": (_recipe({"name": "deep_mlp", "depth": 10, "width": 64, "activation": "relu", "residual": False},
                              {"name": "regression", "dim": 16}, {"name": "adam", "lr": 0.05}), 0.001),
    "gru-copy-sgd": (_recipe({"name": "rnn", "cell": "gru", "hidden": 32},
                             {"name": "sequence", "task": "copy", "seq_len": 16, "dim": 4},
                             {"name": "sgd", "lr": 8.0, "momentum": 0.9}, clipping=NO_CLIP), 0.5),
    "linear-adam-ill-conditioned": (_recipe({"name": "linear"}, {"name": "regression", "dim": 32, "condition": 100.0},
                                            {"name": "adam", "lr": 1.0}), 0.03),
    "mlp-tanh-sgd": (_recipe({"name": "deep_mlp", "depth": 6, "width": 64, "activation": "tanh"},
                             {"name": "regression", "dim": 16}, {"name": "sgd", "lr": 1.5}, clipping=NO_CLIP), 0.005),
}
POLICIES = {"none": {"max_retries": 0}, "ballast": {}}


def run(doc: dict[str, Any], recovery: dict[str, Any]) -> dict[str, Any]:
    """One run through the local recovery loop: its outcome, attempts, final loss and steps executed."""
    recipe = Recipe.model_validate({**copy.deepcopy(doc), "recovery": recovery})
    sinks: list[ListSink] = []  # one per attempt, in order

    def make_sink(spec: AttemptSpec, start: int) -> ListSink:
        sinks.append(ListSink())
        return sinks[-1]

    with tempfile.TemporaryDirectory() as root:
        out = LocalRun(recipe, Path(root), run_in_process, make_sink=make_sink).run()
    # the metric events as the REST series the benchmark measures (a non-finite loss is absent, as there), so
    # both measure with one definition
    data: dict[str, Any] = {"series": {name: {"attempts": [], "steps": [], "values": []} for name in ("loss", "lr")},
                            "attempts": [{"plan": {"lr_probe": a.lr_probe}} for a in out.attempts]}
    for attempt, sink in enumerate(sinks, start=1):
        for m in sink.of_type("metric"):
            for name, col in data["series"].items():
                if m[name] is not None:
                    col["attempts"].append(attempt)
                    col["steps"].append(m["step"])
                    col["values"].append(m[name])
    n = recipe.training.max_steps
    final, complete = final_loss(data, n)
    return {
        "outcome": out.outcome,
        "final": final if complete else None,
        "steps": round(steps_executed(data) / n, 2),
        "attempts": [{"outcome": a.outcome, "changes": {k: v[1] for k, v in a.overrides.items()}}
                     for a in out.attempts],
        "reason": out.last.reason or out.gave_up or "",
    }


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    for name in names or list(SCENARIOS):
        doc, ref_lr = SCENARIOS[name]
        ref = run(deep_merge(doc, {"optimizer": {"lr": ref_lr}}), POLICIES["none"])
        line: dict[str, Any] = {"scenario": name, "reference": {k: ref[k] for k in ("outcome", "final")}}
        for policy, recovery in POLICIES.items():
            res = run(doc, recovery)
            ok = res["final"] is not None and ref["final"]
            res["final_ratio"] = round(res["final"] / ref["final"], 3) if ok else None
            line[policy] = res
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
