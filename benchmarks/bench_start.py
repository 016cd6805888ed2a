"""Start latency: from the claim of a queued run to its first training step, through the real scheduler on a local
Ray (SQLite store), with the breakdown of where the time goes.

Each repeat submits one tiny 1-worker run (``tiny_gpt`` on ``markov``, a few steps) to a store the scheduler
serves, and drives ``Scheduler.tick()`` until the run ends. The timeline of each run, all wall-clock seconds:

* ``claim``: the start of the tick that claims the run (the claim, the attempt's launch description, the channel
  actor's creation and its ``start`` call all happen inside it);
* the channel actor's marks (``RunChannel.marks``): ``channel_up`` (its ``__init__``: a Ray worker process for
  the actor), ``fit_thread``, ``preflight_start`` / ``preflight_done`` (the probe, when the launch asks for one),
  ``train_imported`` (Ray Train and the entry imported), ``fit_called`` (``TorchTrainer`` built, ``fit`` called);
* rank 0's marks (``workers.entry.start_marker``): ``worker_process`` (the Train worker's process was created),
  ``train_loop`` (``train_loop_per_worker`` entered: controller, placement group, worker, process group are up),
  ``setup_done`` (data, model, optimizer built);
* ``first_step``: the ``ts`` of the attempt's first ``metric`` event (stamped by the worker after step 0).

``--variant`` picks the launch path (all three by default, each on a Ray of its own, started by
``RayLauncher.connect`` as the scheduler starts it): ``before`` probes every first attempt
(``preflight_builtin_recipes``) and preloads nothing into Ray's worker processes (``ray_preload_modules: []``), as
the launch path once did; ``after`` is the default launch path now; ``standby`` keeps one standby worker group
(``standby_worker_groups: 1``) and queues the run once the standby is ready, as on a service that has been up for
a while (``adopted``: the launch handed to it; the standby's own start is before the claim and not counted). (The
first two import Ray Train in the channel while a probe runs; that overlap has no switch.) Prints a Markdown table
of median phase times per variant.

Usage: ``python benchmarks/bench_start.py [--repeats 5] [--variant after --variant standby]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import yaml  # noqa: E402

import migrations  # noqa: E402
from contracts.recipe import validate_recipe_data  # noqa: E402
from orchestrator.scheduler import RayLauncher, Scheduler  # noqa: E402
from orchestrator.settings import Settings  # noqa: E402
from orchestrator.store.db import make_engine, make_session_factory, transaction  # noqa: E402
from orchestrator.store.models import Run  # noqa: E402
from orchestrator.store.repo import create_run  # noqa: E402

PHASES: list[tuple[str, str, str]] = [
    ("claim → standby adopted (standby only)", "claim", "adopted"),
    ("claim → channel actor up", "claim", "channel_up"),
    ("channel up → fit thread", "channel_up", "fit_thread"),
    ("preflight probe", "preflight_start", "preflight_done"),
    ("→ Ray Train imported (after the probe)", "fit_thread", "train_imported"),
    ("→ TorchTrainer.fit called", "train_imported", "fit_called"),
    ("fit → worker process created", "fit_called", "worker_process"),
    ("worker process → train loop entered", "worker_process", "train_loop"),
    ("train loop → data + model built", "train_loop", "setup_done"),
    ("setup → first step done", "setup_done", "first_step"),
]
"""(label, from mark, to mark): consecutive phases of the timeline; they add up to claim → first step (a phase
whose marks are missing, e.g. no preflight, counts 0). The channel imports Ray Train while the probe runs, so the
import phase counts only what is left of it once the probe is done."""

VARIANTS = ("before", "after", "standby")


def recipe(name: str, steps: int) -> dict[str, Any]:
    return {
        "name": name,
        "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 1, "n_heads": 2, "d_model": 32},
        "data": {"name": "markov", "vocab_size": 32, "seq_len": 16},
        "training": {"max_steps": steps, "batch_size": 8, "seed": 1},
        "optimizer": {"name": "adamw", "lr": 0.003},
        "schedule": {"warmup_steps": 1, "decay": "constant"},
        "checkpoint": {"every_steps": 1000, "keep": 1},
        "success": {"min_progress": 0.0, "early_min_progress": 0.0},
        "resources": {"num_workers": 1, "cpus_per_worker": 1},
    }


class TimingLauncher(RayLauncher):
    """The real launcher, keeping the channel's marks and the first metric event's timestamp of each run."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.marks: dict[str, float] = {}

    def poll(self, handle: Any, acked: Mapping[int, int]) -> dict[str, Any] | None:
        result = super().poll(handle, acked)
        if result is not None:
            for name, ts in (result.get("marks") or {}).items():
                self.marks.setdefault(name, float(ts))
            metrics = [e for e in result["events"] if e["type"] == "metric"]
            if metrics and "first_step" not in self.marks:
                self.marks["first_step"] = float(min(metrics, key=lambda e: e["seq"])["ts"])
        return result


def settings_for(home: Path, variant: str) -> Settings:
    extra: dict[str, Any] = {}
    if variant == "before":  # the probe for every first attempt, no preloaded worker processes
        extra = {"preflight_builtin_recipes": True, "ray_preload_modules": []}
    if variant == "standby":  # one standby worker group kept started (the claim comes once it is ready)
        extra = {"standby_worker_groups": 1}
    return Settings(home=home, database_url=f"sqlite:///{home / 'ballast.db'}", ray_num_cpus=2,
                    checkpoint_root=str(home / "checkpoints"), scheduler_poll_seconds=0.05, **extra)


def one_run(home: Path, variant: str, steps: int) -> dict[str, float]:
    """One run through a fresh store and scheduler; its marks, relative to the claim (seconds)."""
    settings = settings_for(home, variant)
    migrations.upgrade(settings.database_url)
    factory = make_session_factory(make_engine(settings.database_url))
    doc = recipe(f"bench-start-{variant}", steps)
    launcher = TimingLauncher(settings)
    scheduler = Scheduler(settings, factory, launcher=launcher)
    if variant == "standby":  # a long-running scheduler's standby is up before the run is queued
        _wait_for_standby(scheduler, launcher)
    with transaction(factory) as s:
        run, _ = create_run(session=s, owner="bench", recipe=validate_recipe_data(doc), text=yaml.safe_dump(doc))
        run_id = run.id
    claim = time.time()
    state = "queued"
    while state not in ("succeeded", "failed", "cancelled"):
        scheduler.tick()
        time.sleep(0.05)
        with transaction(factory) as s:
            found = s.get(Run, run_id)
            assert found is not None
            state = found.state
    launcher.shutdown()  # the standby started behind the run (Ray is the caller's)
    assert state == "succeeded", f"{variant}: the run ended {state}"
    marks = {"claim": claim, **launcher.marks}
    return {name: ts - claim for name, ts in marks.items()}


def _wait_for_standby(scheduler: Scheduler, launcher: TimingLauncher, timeout: float = 300.0) -> None:
    import ray

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        scheduler.tick()
        states = [ray.get(h.standby_state.remote()) for h in launcher._standbys.values()]
        if any(st["ready"] for st in states):
            return
        time.sleep(0.2)
    raise TimeoutError("no standby worker group became ready")


def phase_seconds(marks: Mapping[str, float]) -> dict[str, float]:
    out: dict[str, float] = {}
    last = marks["claim"]  # the end of the timeline so far: overlapping phases count only what sticks out
    for label, start, end in PHASES:
        if start in marks and end in marks:
            out[label] = max(0.0, marks[end] - max(marks[start], last))
            last = max(last, marks[end])
        else:
            out[label] = 0.0
    out["claim → first step"] = marks["first_step"] - marks["claim"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5, help="Runs per variant (the median is reported).")
    parser.add_argument("--steps", type=int, default=3, help="Steps of each run.")
    parser.add_argument("--variant", action="append", choices=VARIANTS,
                        help="Launch path(s) to measure (default: both, one after the other).")
    parser.add_argument("--settle", type=float, default=10.0,
                        help="Seconds between Ray's start and the first run of a variant.")
    args = parser.parse_args()
    variants = args.variant or list(VARIANTS)

    seen: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory(prefix="ballast-bench-start-") as tmp:
        for variant in variants:  # a Ray of its own per variant: the worker pool's settings are Ray's start options
            ray_owner = RayLauncher(settings_for(Path(tmp), variant))
            ray_owner.connect()
            time.sleep(args.settle)  # a long-running scheduler's Ray has its prestarted workers up
            try:
                for i in range(args.repeats):
                    phases = phase_seconds(one_run(Path(tmp) / f"{variant}-{i}", variant, args.steps))
                    seen[variant].append(phases)
                    print(f"  {variant:6s} run {i + 1}: claim → first step {phases['claim → first step']:.2f} s  "
                          + "  ".join(f"{k.split('→')[-1].strip()} {v:.2f}" for k, v in phases.items()
                                      if k != "claim → first step"), file=sys.stderr)
            finally:
                ray_owner.shutdown()
    load = os.getloadavg()[0]
    rows = [f"| phase (median of {args.repeats}) | " + " | ".join(variants) + " |",
            "| --- |" + " --- |" * len(variants)]
    for label in [p[0] for p in PHASES] + ["claim → first step"]:
        cells = [f"{statistics.median(r[label] for r in seen[v]):.2f} s" for v in variants]
        if label == "claim → first step":
            label, cells = f"**{label}**", [f"**{c}**" for c in cells]
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    if len(variants) == 2:
        a, b = (statistics.median(r["claim → first step"] for r in seen[v]) for v in variants)
        rows.append(f"\n{variants[1]} / {variants[0]}: {b / a:.2f} (1-minute load average at the end: {load:.1f} "
                    f"on {os.cpu_count()} CPUs).")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
