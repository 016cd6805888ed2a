"""The gradient-collapse rule's margin (``workers/verdict.py: judge_collapse``): how far a healthy run's gradient
norm falls while its loss is still near its start, and what a wider progress bar would catch.

Every window the rule reads (a fresh start's first half) is recorded instead of judged: the median gradient norm
of the window over the median of the first five steps, and the share of the way from the initial loss to the floor
that the window's median loss covered. The rule is replaced by that recorder in this process only (a measurement
harness; nothing else about the runs changes, and no window ends an attempt). Each run goes through the same loop
as ``benchmarks.divergence.fresh`` under ``none``: the scenario's reference and the scenario itself.

``python -m benchmarks.divergence.collapse_margin [--set NAME ...] [--dev]`` prints one line per run: the lowest
norm ratio among its windows short of each progress bar, and the first step at which the rule's norm bar
(``collapse_ratio``, 0.4) would fire under each; then the lowest ratio over every healthy reference. With no
argument: fresh sets 1-9 and the development half (the tenth set and the validation half are held out).
"""

from __future__ import annotations

import statistics
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import torch

import workers.trainer
from benchmarks.divergence import fresh
from benchmarks.divergence.cases import load_cases
from contracts.recipe import Success
from workers.verdict import Verdict, progress

BARS = (0.25, 0.30, 0.35, 0.40, 0.50)
HELD_OUT_SET = "2026-12-07"
WINDOWS: list[tuple[int, float, float]] = []
"""(step, norm ratio, progress) of every window of the run in progress."""


def _record(cfg: Success, *, step: int, max_steps: int, baseline_norm: float | None, norms: Sequence[float],
            losses: Sequence[float], initial_loss: float | None, loss_floor: float | None) -> Verdict:
    """Stands in for ``judge_collapse``: the same inputs, recorded; always healthy."""
    if baseline_norm and norms and losses and loss_floor is not None and step <= max_steps // 2:
        p = progress(statistics.median(losses), initial_loss, loss_floor)
        if p is not None:
            WINDOWS.append((step, statistics.median(norms) / baseline_norm, p))
    return Verdict(None, "recorded")


def runs(set_names: list[str], dev: bool) -> Iterator[tuple[str, str, dict[str, Any]]]:
    """(name, "reference" or "run", recipe) for every scenario of the sets and every case of the dev half."""
    for set_name in set_names:
        for name, (doc, ref_lr) in fresh.SETS[set_name].items():
            yield name, "reference", fresh.reference_doc(doc, ref_lr)
            yield name, "run", doc
    if dev:
        for case in load_cases(("dev",)):
            yield case.name, "reference", case.reference
            yield case.name, "run", case.recipe


def main(argv: list[str]) -> None:
    torch.set_num_threads(1)
    workers.trainer.judge_collapse = _record  # type: ignore[assignment]
    dev = "--dev" in argv or not argv
    set_names = [a for a in argv if a != "--dev" and a != "--set"] or (
        [] if argv else [s for s in fresh.SETS if s != HELD_OUT_SET])
    ratio_bar = Success().collapse_ratio or 0.4
    lowest: dict[float, list[tuple[float, str]]] = {bar: [] for bar in BARS}
    print("run | kind | outcome | lowest norm ratio short of " + " / ".join(f"{b:.0%}" for b in BARS)
          + f" | first step under {ratio_bar:g}x short of each")
    for name, kind, doc in runs(set_names, dev):
        WINDOWS.clear()
        out = fresh.run(doc, fresh.POLICIES["none"])
        mins, fires = [], []
        for bar in BARS:
            ratios = [r for _, r, p in WINDOWS if p < bar]
            mins.append(f"{min(ratios):.2f}" if ratios else "-")
            fire = [s for s, r, p in WINDOWS if p < bar and r < ratio_bar]
            fires.append(str(fire[0]) if fire else "-")
            if kind == "reference" and out["outcome"] == "succeeded" and ratios:
                lowest[bar].append((min(ratios), name))
        print(f"{name} | {kind} | {out['outcome']} | {' / '.join(mins)} | {' / '.join(fires)}", flush=True)
    for bar in BARS:
        if lowest[bar]:
            value, name = min(lowest[bar])
            print(f"healthy references, windows short of {bar:.0%} of the way: lowest norm ratio {value:.2f} ({name})")


if __name__ == "__main__":
    main(sys.argv[1:])
