"""The LR probe (``recovery.lr_probe``): before a retry trains, try its candidate LRs from its start point and train
at the one whose loss ends lowest without an anomaly the detectors would roll back.

Each candidate is a fresh ``GuardedTrainer`` built from the same start (the rollback checkpoint, or the seeded
initialisation), so every candidate sees the same weights, optimizer state, RNG and batches, and the attempt
itself then starts from that point again, untouched by the probe. Every rank runs every candidate (the steps are
collectives) and derives the same choice from the all-gathered losses, so no rank needs to be told. Which LRs are
probed is the policy's (``orchestrator/policy/probe.py``); how one is chosen is ``choose`` below (pure).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from contracts.overrides import apply_overrides, get_path
from contracts.recipe import recipe_to_dict
from contracts.wire import AttemptSpec, ProbePlan
from workers.context import WorkerContext
from workers.sinks import EventSink, StopOnlySink
from workers.trainer import STOPPED, GuardedTrainer


@dataclass(frozen=True)
class CandidateRun:
    lr: float
    losses: tuple[float, ...]
    failed: str | None = None
    """Why the candidate was cut short (an anomaly the detectors would roll back, a non-finite step); None: not."""

    @property
    def score(self) -> float:
        """The mean loss over the last quarter of its steps (at least one): where the loss got to, less the noise
        of a single batch; inf for a failed candidate or a non-finite loss."""
        if self.failed is not None or not self.losses:
            return math.inf
        tail = self.losses[-max(1, len(self.losses) // 4):]
        mean = sum(tail) / len(tail)
        return mean if math.isfinite(mean) else math.inf


def choose(runs: Sequence[CandidateRun]) -> tuple[int, str]:
    """The candidate to train at, and why: the lowest score, i.e. the loss that fell furthest without an anomaly
    the detectors would roll back (an exact tie: the lower LR). When every candidate failed, the lowest LR (the
    safest there is; if it diverges too, the next retry tightens from it).

    No band of near-ties goes to the lower LR: on the development half such a band (1%) picked the lowest candidate
    of ``dev-warmup-peak`` where two scores were 0.8% apart, and that LR, 16x below the cut, ended at 1.02x the
    reference where the retry at the cut LR ends at 0.98x; over so few steps a lower LR has not shown it keeps up."""
    if not runs:
        raise ValueError("choose: no candidate runs")
    finite = [i for i, r in enumerate(runs) if math.isfinite(r.score)]
    if not finite:
        return min(range(len(runs)), key=lambda i: runs[i].lr), "every candidate failed; the lowest LR is kept"
    return min(finite, key=lambda i: (runs[i].score, runs[i].lr)), "lowest loss"


def highest_is_best(runs: Sequence[CandidateRun]) -> bool:
    """Whether the highest LR tried is the one ``choose`` picks, having trained cleanly: the loss fell fastest at
    the top of the range, so a higher LR may do better still (``ProbePlan.extend``)."""
    top = max(range(len(runs)), key=lambda i: runs[i].lr)
    return runs[top].failed is None and choose(runs)[0] == top


def past_the_best(runs: Sequence[CandidateRun]) -> bool:
    """Whether the descent through the candidates (highest LR first) may stop: the last one scored worse than one
    above it that trained cleanly. Lower LRs descend slower still over a probe's few steps, so they would not be
    chosen (``choose``); the steps go to the extension instead (``ProbePlan.extend``: an LR between the cut and
    the one that failed)."""
    if len(runs) < 2:
        return False
    best_above = min(r.score for r in runs[:-1])
    return math.isfinite(best_above) and runs[-1].score > best_above


def _fmt(x: float) -> str:
    return format(x, ".4g")


def describe(runs: Sequence[CandidateRun], pick: int, why: str, start_step: int) -> str:
    """The probe in one line for the attempt's reason."""
    parts = [f"{_fmt(r.lr)} → {r.failed}" if r.failed else f"{_fmt(r.lr)} → loss {_fmt(r.score)}" for r in runs]
    return f"lr probe from step {start_step}: {'; '.join(parts)}; chose {_fmt(runs[pick].lr)} ({why})"


def with_lr(spec: AttemptSpec, lr: float, settings: Mapping[str, Any] | None = None) -> AttemptSpec:
    """``spec`` training at ``lr`` (and ``settings``: dotted recipe path → value), without a probe of its own."""
    recipe = apply_overrides(spec.recipe, settings) if settings else spec.recipe
    recipe = recipe.model_copy(update={"optimizer": recipe.optimizer.model_copy(update={"lr": lr})})
    return replace(spec, recipe=recipe, lr_probe=None)


def run_probe(spec: AttemptSpec, plan: ProbePlan, ctx: WorkerContext, resume_dir: str | Path | None,
              sink: EventSink | None = None) -> tuple[AttemptSpec, dict[str, Any]]:
    """Probe ``plan``'s candidates from ``spec``'s start point (every rank). Returns the spec to train with (the
    chosen LR, no probe) and the ``lr_probe`` event's data. A stop request on ``sink`` (rank 0's) ends the probe
    after the step that sees it; the attempt then stops at its first step."""
    runs, start_step = _search(spec, plan, ctx, resume_dir, None if sink is None else StopOnlySink(sink))
    pick, why = choose(runs)
    chosen = runs[pick].lr
    clean = runs[pick].failed is None
    replayed = clean and pick == 0 and bool(plan.replay)
    settings = plan.replay if replayed else plan.if_clean
    reason = describe(runs, pick, why, start_step)
    if replayed:
        reason += ("; the diverged settings trained cleanly through the step that failed, so the divergence was "
                   f"not theirs: kept ({_changes(spec, settings)})")
    dropped = _ramps(spec, plan) if clean and not replayed else ""
    if dropped:
        reason += f"; {dropped} (it trained cleanly from here at a constant LR)"
    event = {
        "start_step": start_step,
        "steps": plan.steps,
        "steps_run": sum(len(r.losses) for r in runs),
        "candidates": [{"lr": r.lr, "score": r.score if math.isfinite(r.score) else None, "failed": r.failed,
                        "steps": len(r.losses)} for r in runs],
        "chosen": chosen,
        "reason": reason,
    }
    if not clean:
        return with_lr(spec, chosen), event
    if settings:
        event["if_clean"] = dict(settings)
    if spec.rewarm_steps:
        event["rewarm_steps"] = 0
    return replace(with_lr(spec, chosen, settings), rewarm_steps=0), event


def _search(spec: AttemptSpec, plan: ProbePlan, ctx: WorkerContext, resume_dir: str | Path | None,
            quiet: EventSink | None) -> tuple[list[CandidateRun], int]:
    """Train the plan's candidates, highest first, while each is the best so far (``past_the_best``), then its
    extension while the highest LR tried is the best; the runs, and the step they started from."""
    runs: list[CandidateRun] = []
    start_step = 0

    def train(lr: float, steps: int, settings: Mapping[str, Any] | None = None) -> str | None:
        nonlocal start_step
        trainer = GuardedTrainer(with_lr(spec, lr, settings), ctx, sink=quiet, resume_dir=resume_dir)
        start_step = trainer.start_step
        losses, failed = trainer.probe(steps)
        runs.append(CandidateRun(lr=lr, losses=tuple(losses), failed=failed))
        return failed

    for i, lr in enumerate(plan.candidates):
        replaying = bool(plan.replay) and i == 0  # the ended attempt's settings: every one the retry changed
        failed = train(lr, plan.steps_of(i), plan.replay if replaying else None)
        if failed == STOPPED:
            break
        if replaying and failed is None:
            break  # the replay trained cleanly: the settings were not the cause, and they are the user's to tune
        if past_the_best(runs):
            break
    for lr in plan.extend:
        if runs[-1].failed == STOPPED or not highest_is_best(runs):
            break
        train(lr, plan.steps)
    return runs, start_step


def _ramps(spec: AttemptSpec, plan: ProbePlan) -> str:
    """The ramps a clean pick makes unnecessary, in words (empty: none): the re-warm, and the warmup the retry
    added (``plan.if_clean``). The chosen candidate trained its steps from the attempt's very start point (its
    weights, optimizer state and batches) at the warmed-up LR held constant, with no anomaly: easing that LR in
    buys no stability, and it costs a short run final loss (BENCHMARKS.md, 2026-12-05)."""
    parts = [f"re-warm {spec.rewarm_steps}→0 steps"] if spec.rewarm_steps else []
    if plan.if_clean:
        parts.append(_changes(spec, plan.if_clean))
    return ", ".join(parts)


def _changes(spec: AttemptSpec, settings: Mapping[str, Any]) -> str:
    """``settings`` (dotted path → value) as changes from ``spec``'s recipe, in words."""
    doc = recipe_to_dict(spec.recipe)
    return ", ".join(f"{path} {get_path(doc, path)}→{value}" for path, value in settings.items())
