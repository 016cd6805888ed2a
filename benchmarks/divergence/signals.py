"""What a run shows while it trains, for runs that end healthy and runs that end under-trained: a harness for
looking for a run-time signal, not a policy. Each scenario (``fresh.py``'s sets) runs under ``none`` beside its
reference, in this process; per run it prints the numbers a rule could read without the reference:

- ``end``: the share of the way from the first loss to the data's floor covered by the final loss (mean of the
  last 20 steps), and ``ratio``, the final loss over the reference's (what the rule would have to predict);
- ``giveback``: the most the smoothed loss (the loss detector's EMA) rose above its best, as a share of the
  progress from the initial loss to that best;
- ``flat``: the longest stretch, in steps, in which the best smoothed loss improved by less than 1% of the way to
  the floor while short of 75% of it (the stall rule's clock);
- ``gn``: the lowest median pre-clip gradient norm over 20 steps, over the median of the first five;
- ``ur``: the largest update-to-weight ratio measured (every 10th step);
- ``noise``: the largest batch-to-batch standard deviation of the loss over 25-step windows.

``python -m benchmarks.divergence.signals --set NAME`` or ``... signals NAME ...``; labels: ``ref``, ``ctl``
(a control), ``ok`` (ends within 5% of its reference), ``BAD`` (ends SUCCEEDED above 5%), ``diverged``.

``--lr-check`` (before the names) prints instead, per run, what a short LR probe from the run's own state at the
end of its warmup (step 20 without one) shows: the recipe's LR and a quarter of it, 10 steps each
(``workers.lr_probe.run_probe``), and ``lower_gain``, how much lower the quarter LR's score is (positive: the lower
LR looked better).
"""

from __future__ import annotations

import copy
import math
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from api.cli.local_run import LocalRun
from api.cli.train_cmd import run_in_process
from benchmarks.divergence.fresh import POLICIES, SETS, reference_doc
from contracts.recipe import LossSpikeDetector, Recipe
from contracts.wire import AttemptSpec, ProbePlan
from workers.data import build_data
from workers.detectors.base import Ema
from workers.entry import plain_context, run_attempt
from workers.lr_probe import run_probe
from workers.sinks import ListSink
from workers.verdict import final_loss, progress

ALPHA = LossSpikeDetector().ema_alpha
"""The loss detector's EMA coefficient (its default)."""


def curves(doc: dict[str, Any]) -> dict[str, Any]:
    """One run under ``none``: its outcome and first attempt's per-step loss, gradient norm and update ratio."""
    recipe = Recipe.model_validate({**copy.deepcopy(doc), "recovery": POLICIES["none"]})
    sinks: list[ListSink] = []

    def make_sink(spec: AttemptSpec, start: int) -> ListSink:
        sinks.append(ListSink())
        return sinks[-1]

    with tempfile.TemporaryDirectory() as root:
        out = LocalRun(recipe, Path(root), run_in_process, make_sink=make_sink).run()
    metrics = sinks[0].of_type("metric")
    source = build_data(recipe.data, seed=recipe.training.seed, batch_size=recipe.training.batch_size)
    return {"outcome": out.outcome, "floor": source.loss_floor,
            "loss": [m["loss"] for m in metrics], "gn": [m["grad_norm"] for m in metrics],
            "ur": [x["update_ratio"] for x in sinks[0].of_type("layer_stats") if x["update_ratio"] is not None]}


def _final(losses: list[float | None]) -> float | None:
    """The verdict's final loss: the mean of the last 20 finite losses (a non-finite step's loss is None here)."""
    return final_loss([math.nan if x is None else x for x in losses], 20)


def stats(c: dict[str, Any]) -> dict[str, float | None]:
    """The numbers of the module docstring, for one run's curves."""
    losses = [x for x in c["loss"] if x is not None and math.isfinite(x)]
    floor, final = c["floor"], _final(c["loss"])
    if not losses or floor is None or final is None or losses[0] <= floor:
        return {}
    first = losses[0]
    way = first - floor
    ema, best, giveback = Ema(ALPHA), math.inf, 0.0
    mark, flat = (0, math.inf), 0
    for step, x in enumerate(losses):
        ema.update(x)
        if ema.n >= 5 and ema.mean < best:
            best = ema.mean
        if best < math.inf and first - best > 0.1 * first:
            giveback = max(giveback, (ema.mean - best) / (first - best))
        if best < mark[1] - 0.01 * way:
            mark = (step, best)
        if (progress(best, first, floor) or 0.0) < 0.75:
            flat = max(flat, step - mark[0])
    norms = [g for g in c["gn"] if g is not None and math.isfinite(g)]
    base = statistics.median(norms[:5]) if norms else 0.0
    gn = min((statistics.median(norms[i:i + 20]) / base for i in range(0, max(1, len(norms) - 19))), default=None)
    noise = max((math.sqrt(statistics.mean((losses[i + 1] - losses[i]) ** 2 / 2 for i in range(a, a + 24)))
                 for a in range(0, len(losses) - 25, 25)), default=None)
    return {"end": progress(final, first, floor), "giveback": giveback, "flat": float(flat),
            "gn": gn if base > 0 else None, "ur": max(c["ur"], default=None), "noise": noise}


def lr_check(doc: dict[str, Any], lr: float) -> dict[str, Any]:
    """Train ``doc`` at ``lr`` under ``none``, then probe ``lr`` and ``lr / 4`` for 10 steps each from its
    checkpoint at the end of the warmup (step 20 without one): the candidates' scores."""
    at = int(doc["schedule"].get("warmup_steps") or 0) or 20
    recipe = Recipe.model_validate({**copy.deepcopy(doc), "optimizer": {**doc["optimizer"], "lr": lr},
                                    "checkpoint": {"every_steps": at, "keep": 1000}, "recovery": POLICIES["none"]})
    with tempfile.TemporaryDirectory() as root:
        outcome = run_attempt(AttemptSpec(recipe=recipe, checkpoint_dir=f"{root}/run"), ListSink()).outcome
        checkpoint = Path(root) / "run" / f"step_{at:08d}"
        if not checkpoint.exists():
            return {"outcome": outcome, "at": at}
        plan = ProbePlan(candidates=(lr, lr / 4), steps=10)
        spec = AttemptSpec(recipe=recipe, checkpoint_dir=f"{root}/probe", resume_from=str(checkpoint), lr_probe=plan)
        _, event = run_probe(spec, plan, plain_context(recipe), checkpoint)
    scores = [c["score"] for c in event["candidates"]]
    gain = (scores[0] - scores[1]) / scores[0] if len(scores) == 2 and None not in scores else None
    return {"outcome": outcome, "at": at, "scores": scores, "lower_gain": gain}


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    every = {name: entry for scenarios in SETS.values() for name, entry in scenarios.items()}
    check = names[:1] == ["--lr-check"]
    names = names[1:] if check else names
    if names[:1] == ["--set"]:
        names = list(SETS[names[1]]) + names[2:]
    if check:
        print("| scenario | run | LR | probed at | score at LR, LR / 4 | lower_gain |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name in names:
            doc, ref_lr = every[name]
            control = name.startswith("control")
            for which, lr in [("ctl" if control else "run", doc["optimizer"]["lr"])] + (
                    [] if control or ref_lr <= 0 else [("ref", ref_lr)]):
                r = lr_check(doc, lr)
                scores = ", ".join(_fmt(x) for x in r.get("scores") or [])
                print(f"| {name} | {which} | {lr:g} | {r['at']} | {scores} | {_fmt(r.get('lower_gain'))} |", flush=True)
        return
    print("| scenario | run | ratio | end | giveback | flat | gn | ur | noise |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in names:
        doc, ref_lr = every[name]
        run = curves(doc)
        runs = [("ctl" if name.startswith("control") else "run", run)]
        ref = None if name.startswith("control") else curves(reference_doc(doc, ref_lr))
        if ref is not None:
            runs.insert(0, ("ref", ref))
        for which, c in runs:
            ratio = None
            if which == "run" and ref is not None:
                fr, fu = _final(ref["loss"]), _final(c["loss"])
                ratio = fu / fr if fr and fu else None
            label = which if which != "run" else (
                "diverged" if c["outcome"] != "succeeded" else "BAD" if ratio and ratio > 1.05 else "ok")
            s = stats(c) if c["outcome"] == "succeeded" else {}
            cells = [_fmt(ratio)] + [_fmt(s.get(k)) for k in ("end", "giveback", "flat", "gn", "ur", "noise")]
            print(f"| {name} | {label} | " + " | ".join(cells) + " |", flush=True)


def _fmt(x: float | None) -> str:
    return "" if x is None else format(x, ".3g")


if __name__ == "__main__":
    main(sys.argv[1:])
