"""Check that every case really diverges, independently of Ballast's detectors: its unstable recipe and its
reference are trained in this process (``workers.entry.run_attempt``, one torch thread like a service worker)
with **every detector disabled** and no recovery, so each runs all its steps (or until the loss is non-finite).

A case qualifies when the unguarded unstable run ends non-finite or with a final loss (mean of the last 20 steps)
at least ``--min-ratio`` (1.5) × the reference's, and the reference ends finite. Controls are checked the other
way round: their unguarded run must end finite (it is its own reference). The vanishing case qualifies when its
final loss is >= 1.5x its (residual) reference. ``--repeat 2`` also trains each recipe twice and requires
bit-identical loss sequences (reproducibility).

    .venv/bin/python -m benchmarks.divergence.verify [--half dev|validation|all] [--case NAME] [--repeat 2]
"""

from __future__ import annotations

import argparse
import copy
import math
import sys
import tempfile
from typing import Any

from benchmarks.divergence.cases import HALVES, load_cases
from benchmarks.divergence.metrics import FINAL_WINDOW

DETECTORS = ("nonfinite", "grad_norm_spike", "loss_spike", "vanishing", "stagnation", "oscillation")


def unguarded(recipe: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(recipe)
    doc["detectors"] = {name: {"enabled": False} for name in DETECTORS}
    doc["recovery"] = {"max_retries": 0}
    return doc


def train(recipe: dict[str, Any]) -> list[float]:
    import torch

    from contracts.recipe import validate_recipe_data
    from contracts.wire import AttemptSpec
    from workers.entry import run_attempt

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="ballast-verify-") as tmp:
        out = run_attempt(AttemptSpec(recipe=validate_recipe_data(unguarded(recipe)), checkpoint_dir=tmp))
    return [float(v) for v in out.losses]


def final(losses: list[float], max_steps: int) -> float:
    if len(losses) < max_steps or any(not math.isfinite(v) for v in losses[-FINAL_WINDOW:]):
        return math.inf
    tail = losses[-FINAL_WINDOW:]
    return sum(tail) / len(tail)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--half", choices=[*HALVES, "all"], default="all")
    parser.add_argument("--case", action="append", default=None)
    parser.add_argument("--min-ratio", type=float, default=1.5)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args(argv)
    cases = load_cases(HALVES if args.half == "all" else (args.half,), args.case)
    failures = 0
    print("| case | expected | unguarded final | reference final | ratio | reproducible | qualifies |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case in cases:
        runs = [train(case.recipe) for _ in range(args.repeat)]
        same = all(list(map(repr, r)) == list(map(repr, runs[0])) for r in runs[1:])  # NaN-safe
        bad = final(runs[0], case.max_steps)
        if case.expected == "control":
            ref = bad
            ok = math.isfinite(bad)
        else:
            ref = final(train(case.reference), case.max_steps)
            ok = math.isfinite(ref) and (not math.isfinite(bad) or bad >= args.min_ratio * ref)
        ok = ok and same
        failures += not ok
        ratio = bad / ref if math.isfinite(bad) and math.isfinite(ref) and ref > 0 else math.inf
        print(f"| {case.name} | {case.expected} | {bad:.4g} | {ref:.4g} | {ratio:.2f} | "
              f"{'yes' if same else 'NO'}{'' if args.repeat > 1 else ' (not checked)'} | {'yes' if ok else 'NO'} |",
              flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
