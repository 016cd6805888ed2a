"""Recovery latency and service overhead, measured through the real scheduler on a local Ray (SQLite store).

1. Divergence → next attempt: the time from the diverged attempt's ``end`` event to the first step (metric
   event) of the next attempt, both stamped by the worker's clock (``ActorSink`` adds ``ts``). Once with the
   rollback applied *in place* (the running workers load the checkpoint, apply the overrides, go on as the next
   attempt) and once with a full worker-group restart (``recovery.in_place: false``): a new ``TorchTrainer``,
   placement group, worker processes, process group.
2. Steps/s of the same recipe through the service (Ray Train worker, events through the channel actor into the
   store) vs ``workers.entry.run_attempt`` in a plain process with a list sink, both on one CPU thread (a Ray
   worker with ``num_cpus=1`` runs torch single-threaded). Start-up is excluded from the rate: from the first
   to the last step's event.

Usage: ``python benchmarks/bench_recovery.py [--repeats N] [--steps N]``. Prints a Markdown table.
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


def recipe(name: str, *, max_steps: int, in_place: bool = True, fault_step: int | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": name,
        "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 1, "n_heads": 2, "d_model": 32},
        "data": {"name": "markov", "vocab_size": 32, "seq_len": 16},
        "training": {"max_steps": max_steps, "batch_size": 8, "seed": 1},
        "optimizer": {"name": "adamw", "lr": 0.003},
        "schedule": {"warmup_steps": 5, "decay": "constant"},
        "checkpoint": {"every_steps": 10, "keep": 3},
        "detectors": {"grad_norm_spike": {"action": "rollback", "warmup_steps": 10}},
        "recovery": {"rewarm_steps": 5, "in_place": in_place},
        "faults": [],
    }
    if fault_step is not None:
        doc["faults"] = [{"type": "grad_scale", "step": fault_step, "factor": 1e4, "attempt": 1}]
    return doc


class RecordingLauncher(RayLauncher):
    """The real launcher, keeping every event the scheduler drained (with the workers' timestamps)."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.events: list[dict[str, Any]] = []

    def poll(self, handle: Any, acked: Mapping[int, int]) -> dict[str, Any] | None:
        result = super().poll(handle, acked)
        if result is not None:
            seen = {(e["attempt"], e["seq"]) for e in self.events}
            self.events.extend(e for e in result["events"] if (e["attempt"], e["seq"]) not in seen)
        return result


def through_service(doc: dict[str, Any], home: Path) -> tuple[str, list[dict[str, Any]], float]:
    """Submit ``doc`` to a fresh store and drive the scheduler until the run ends; (state, events, wall s)."""
    settings = Settings(home=home, database_url=f"sqlite:///{home / 'ballast.db'}",
                        checkpoint_root=str(home / "checkpoints"), scheduler_poll_seconds=0.1)
    migrations.upgrade(settings.database_url)
    factory = make_session_factory(make_engine(settings.database_url))
    with transaction(factory) as s:
        run, _ = create_run(session=s, owner="bench", recipe=validate_recipe_data(doc), text=yaml.safe_dump(doc))
        run_id = run.id
    launcher = RecordingLauncher(settings)
    scheduler = Scheduler(settings, factory, launcher=launcher)
    started = time.monotonic()
    state = "queued"
    while state not in ("succeeded", "failed", "cancelled"):
        scheduler.tick()
        time.sleep(0.1)
        with transaction(factory) as s:
            found = s.get(Run, run_id)
            assert found is not None
            state = found.state
    return state, launcher.events, time.monotonic() - started


def recovery_gap(events: list[dict[str, Any]]) -> float:
    end = next(e for e in events if e["attempt"] == 1 and e["type"] == "end")
    first = min((e for e in events if e["attempt"] == 2 and e["type"] == "metric"), key=lambda e: e["seq"])
    return float(first["ts"] - end["ts"])


def steps_per_s(stamped: list[tuple[int, float]]) -> float:
    stamped = sorted(stamped)
    (s0, t0), (s1, t1) = stamped[0], stamped[-1]
    return (s1 - s0) / (t1 - t0)


def plain(doc: dict[str, Any], home: Path) -> float:
    import torch

    from contracts.wire import AttemptSpec
    from workers.entry import run_attempt
    from workers.sinks import ListSink

    class StampingSink(ListSink):
        def emit(self, type: str, data: dict[str, Any]) -> None:
            super().emit(type, data)
            self.events[-1]["ts"] = time.time()

    torch.set_num_threads(1)
    sink = StampingSink()
    run_attempt(AttemptSpec(recipe=validate_recipe_data(doc), checkpoint_dir=str(home / "plain")), sink)
    return steps_per_s([(e["data"]["step"], e["ts"]) for e in sink.events if e["type"] == "metric"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2, help="Runs per recovery mode.")
    parser.add_argument("--steps", type=int, default=300, help="Steps of the throughput recipe.")
    args = parser.parse_args()

    import ray

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="ballast-bench-") as tmp:
            root = Path(tmp)
            gaps: dict[str, list[float]] = {"in place": [], "full restart": []}
            walls: dict[str, list[float]] = {"in place": [], "full restart": []}
            for i in range(args.repeats):
                for mode, in_place in (("in place", True), ("full restart", False)):
                    doc = recipe(f"bench-{'inplace' if in_place else 'restart'}", max_steps=60, in_place=in_place,
                                 fault_step=35)
                    state, events, wall = through_service(doc, root / f"{mode.replace(' ', '-')}-{i}")
                    assert state == "succeeded", f"{mode}: run ended {state}"
                    gaps[mode].append(recovery_gap(events))
                    walls[mode].append(wall)
                    print(f"  {mode:12s} run {i + 1}: divergence → next attempt's first step "
                          f"{gaps[mode][-1]:.2f} s (run wall {wall:.1f} s)", file=sys.stderr)
            rows.append("| recovery mode | divergence → first step of the next attempt (median) | runs | "
                        "whole run (median, incl. start-up) |")
            rows.append("| --- | --- | --- | --- |")
            for mode in gaps:
                rows.append(f"| {mode} | {statistics.median(gaps[mode]):.2f} s "
                            f"(min {min(gaps[mode]):.2f}, max {max(gaps[mode]):.2f}) | {len(gaps[mode])} | "
                            f"{statistics.median(walls[mode]):.1f} s |")
            ratio = statistics.median(gaps["full restart"]) / max(statistics.median(gaps["in place"]), 1e-9)
            rows.append(f"\nIn-place recovery is {ratio:.1f}x faster to resume than a full worker-group restart.\n")

            rows.append("| checkpoint every | plain process (`run_attempt` + list sink) | through the service "
                        "(Ray Train worker → channel actor → store) | service / plain |")
            rows.append("| --- | --- | --- | --- |")
            for every in (10, 100):
                doc = recipe(f"bench-throughput-{every}", max_steps=args.steps)
                doc["checkpoint"]["every_steps"] = every
                state, events, wall = through_service(doc, root / f"service-{every}")
                assert state == "succeeded", f"throughput run ended {state}"
                service = steps_per_s([(e["data"]["step"], e["ts"]) for e in events if e["type"] == "metric"])
                local = plain(doc, root / f"plain-{every}")
                rows.append(f"| {every} steps | {local:.1f} steps/s | {service:.1f} steps/s | {service / local:.2f} |")
                print(f"  throughput, checkpoint every {every}: plain {local:.1f}, service {service:.1f} steps/s "
                      f"(service run wall {wall:.1f} s)", file=sys.stderr)
            rows.append(f"\n({args.steps} steps each; rates from the first to the last step, start-up excluded.)")
    finally:
        ray.shutdown()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
