"""Recovery latency and service overhead, measured through the real scheduler on a local Ray (SQLite store).

1. Divergence → next attempt: the time from the diverged attempt's ``end`` event to the first step (metric
   event) of the next attempt, both stamped by the worker's clock (``ActorSink`` adds ``ts``). Once with the
   rollback applied *in place* (the running workers load the checkpoint, apply the overrides, go on as the next
   attempt) and once with a full worker-group restart (``recovery.in_place: false``): a new ``TorchTrainer``,
   placement group, worker processes, process group.
2. Steps/s of the same recipe through the service (Ray Train worker, events through the channel actor into the
   store) vs ``workers.entry.run_attempt`` in a plain process with a list sink, both on one CPU thread (a Ray
   worker with ``num_cpus=1`` runs torch single-threaded), checkpointing every 10 and every 100 steps, the pairs
   interleaved in one run. Start-up is excluded from the rate: from the first to the last step's event. Beside
   each rate, the CPU per step of the training thread and of the whole worker process (``ThreadCpu``, from
   ``/proc``), and how much of the wall time the training thread ran, service over plain (steps/s × CPU per
   step): the CPU a step costs moves with the neighbours' load, the share of time the loop gets to run much less.
3. The loop's stall per checkpoint for a model with >= 50 MB of state (weights + AdamW moments), through the
   service and in a plain process, beside the time to copy that state to host memory, in the same run: the
   checkpoint event's ``timing`` (``stall_s``: the loop's time in ``Checkpointer.save``, ``copy_s``: its
   ``to_host`` part, ``write_s``: the background write) and, measured from outside, the checkpoint step's extra
   time over the median step (the metric events' timestamps).

Usage: ``python benchmarks/bench_recovery.py [--parts recovery,throughput,stall] [--repeats N] [--steps N]
[--throughput-repeats N]``. Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
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


class ThreadCpu:
    """The CPU time of every thread of the processes whose command line contains ``marker`` (the Ray Train worker,
    or the plain child), sampled from ``/proc`` every ``interval`` seconds while the context is open.

    Steps/s on a shared machine moves with the neighbours' load far more than the CPU a step costs, so the
    throughput part also reports the training thread's CPU per step on each side: a gap in that figure is work
    the service adds to the loop itself; a gap in steps/s alone is the loop waiting (for a core, or for the GIL)."""

    TICK = os.sysconf("SC_CLK_TCK")

    def __init__(self, marker: str, interval: float = 0.2) -> None:
        self.marker, self.interval = marker, interval
        self.samples: list[tuple[float, dict[int, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="bench-thread-cpu", daemon=True)

    def __enter__(self) -> ThreadCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval):
            self.samples.append((time.time(), self._threads()))

    def _threads(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for pid in (p for p in os.listdir("/proc") if p.isdigit()):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if self.marker.encode() not in f.read():
                        continue
                for tid in os.listdir(f"/proc/{pid}/task"):
                    with open(f"/proc/{pid}/task/{tid}/stat") as f:
                        fields = f.read().rpartition(")")[2].split()
                    out[int(tid)] = (int(fields[11]) + int(fields[12])) / self.TICK  # utime + stime
            except OSError:  # the process or thread ended between the listing and the read
                continue
        return out

    def per_step(self, stamped: list[tuple[int, float]]) -> tuple[float, float]:
        """(the busiest thread's, all threads') CPU seconds per step between the first and the last sample inside
        the steps' time span, the steps in between interpolated from their timestamps."""
        stamped = sorted(stamped, key=lambda st: st[1])
        times = [t for _, t in stamped]
        inside = [s for s in self.samples if times[0] <= s[0] <= times[-1]]
        assert len(inside) >= 2, "the steps' span holds fewer than two samples: run more steps"
        (t0, a), (t1, b) = inside[0], inside[-1]

        def step_at(t: float) -> float:
            i = min(max(bisect.bisect_left(times, t), 1), len(times) - 1)
            (s0, u0), (s1, u1) = stamped[i - 1], stamped[i]
            return s0 + (s1 - s0) * (t - u0) / max(u1 - u0, 1e-9)

        steps = step_at(t1) - step_at(t0)
        used = {tid: b[tid] - a.get(tid, 0.0) for tid in b}
        return max(used.values()) / steps, sum(used.values()) / steps


def big_recipe(name: str, *, max_steps: int, every: int) -> dict[str, Any]:
    """A tiny_gpt with ~4.8 M parameters: 57 MB of fp32 weights and AdamW moments, short sequences so a CPU
    step stays well under a second."""
    doc = recipe(name, max_steps=max_steps)
    doc["model"] = {"name": "tiny_gpt", "vocab_size": 64, "context": 16, "n_layers": 6, "n_heads": 4,
                    "d_model": 256}
    doc["data"] = {"name": "markov", "vocab_size": 64, "seq_len": 16}
    doc["training"]["batch_size"] = 4
    doc["checkpoint"] = {"every_steps": every, "keep": 2}
    # lr 3e-3 with a 5-step warmup overshoots this model (the loss rises 24% above the untrained model's at step 7,
    # and the detectors rightly roll it back): a gentler LR keeps the measured run one attempt long
    doc["optimizer"] = {"name": "adamw", "lr": 5e-4}
    doc["schedule"] = {"warmup_steps": 20, "decay": "constant"}
    doc["detectors"] = {}
    doc["success"] = {"min_progress": 0.0, "early_min_progress": 0.0}  # a stall measurement, not a learning one
    return doc


def stalls(events: list[dict[str, Any]], every: int) -> dict[str, float]:
    """Medians over an attempt's checkpoints (the last one excluded: the end drains it): the loop's time in
    ``save``, its copy to host memory, the background write, the state's size, and the checkpoint step's extra
    time over the median ordinary step, from the metric events' timestamps."""
    metrics = sorted((e["data"]["step"], e["ts"]) for e in events if e["type"] == "metric")
    checkpoints = sorted((e["data"] for e in events if e["type"] == "checkpoint"), key=lambda c: c["step"])[:-1]
    gaps = {s1: t1 - t0 for (_, t0), (s1, t1) in zip(metrics, metrics[1:], strict=False)}
    # the metric of step s1 follows the checkpoint after s1 completed steps when s1 % every == 0
    ordinary = statistics.median(g for step, g in gaps.items() if step % every != 0)
    outside = [gaps[c["step"]] - ordinary for c in checkpoints if c["step"] in gaps]
    return {
        "stall_s": statistics.median(c["timing"]["stall_s"] for c in checkpoints),
        "copy_s": statistics.median(c["timing"]["copy_s"] for c in checkpoints),
        "write_s": statistics.median(c["timing"]["write_s"] for c in checkpoints),
        "mb": statistics.median(c["timing"]["bytes"] for c in checkpoints) / 1e6,
        "outside_s": statistics.median(outside),
        "step_s": ordinary,
        "n": float(len(checkpoints)),
    }


def plain_events(doc: dict[str, Any], home: Path) -> list[dict[str, Any]]:
    """``run_attempt`` in a fresh plain process (no Ray, one torch thread), its events stamped like the
    ``ActorSink``'s. A subprocess, not this one: the benchmark's own process holds a Ray driver and the
    scheduler, which slowed an in-process run 2-5x against a fresh process."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "recipe.json").write_text(json.dumps(doc))
    subprocess.run([sys.executable, __file__, "--plain-child", str(home)], check=True, cwd=REPO)
    events: list[dict[str, Any]] = json.loads((home / "events.json").read_text())
    return events


def plain_child(home: Path) -> None:
    """The plain process of ``plain_events``: the recipe from ``home/recipe.json``, events to ``events.json``."""
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
    doc = json.loads((home / "recipe.json").read_text())
    run_attempt(AttemptSpec(recipe=validate_recipe_data(doc), checkpoint_dir=str(home / "plain")), sink)
    (home / "events.json").write_text(json.dumps(sink.events))


def throughput(root: Path, steps: int, repeats: int, rows: list[str]) -> None:
    """Service and plain steps/s at checkpoints every 10 and every 100 steps, interleaved, medians of pairs."""
    rates: dict[tuple[int, str], list[float]] = {}
    for i in range(repeats):
        for every in (10, 100):
            doc = recipe(f"bench-throughput-{every}", max_steps=steps)
            doc["checkpoint"]["every_steps"] = every
            with ThreadCpu("ray::RayTrainWorker") as service_cpu:
                state, events, wall = through_service(doc, root / f"service-{every}-{i}")
            assert state == "succeeded", f"throughput run ended {state}"
            with ThreadCpu("--plain-child") as plain_cpu:
                plain = plain_events(doc, root / f"plain-{every}-{i}")
            stamps = {"service": [(e["data"]["step"], e["ts"]) for e in events if e["type"] == "metric"],
                      "plain": [(e["data"]["step"], e["ts"]) for e in plain if e["type"] == "metric"]}
            service, local = steps_per_s(stamps["service"]), steps_per_s(stamps["plain"])
            (loop_s, proc_s), (loop_p, proc_p) = (service_cpu.per_step(stamps["service"]),
                                                  plain_cpu.per_step(stamps["plain"]))
            for key, value in (("service", service), ("plain", local), ("ratio", service / local),
                               ("loop cpu", loop_s / loop_p), ("loop ms", loop_s * 1e3),
                               ("plain loop ms", loop_p * 1e3), ("proc ms", proc_s * 1e3),
                               ("plain proc ms", proc_p * 1e3),
                               # the share of wall time the training thread ran, service over plain: the ratio
                               # of steps/s with the CPU a step cost taken out (it moves with the neighbours)
                               ("busy", service * loop_s / (local * loop_p))):
                rates.setdefault((every, key), []).append(value)
            print(f"  throughput {i + 1}, checkpoint every {every}: plain {local:.1f}, service {service:.1f} "
                  f"steps/s, ratio {service / local:.2f}, busy {rates[(every, 'busy')][-1]:.2f}; training thread "
                  f"CPU/step {loop_p * 1e3:.2f} → {loop_s * 1e3:.2f} ms, whole worker {proc_p * 1e3:.2f} → "
                  f"{proc_s * 1e3:.2f} ms (service run wall {wall:.1f} s)", file=sys.stderr)
    rows.append("| checkpoint every | plain process (`run_attempt` + list sink) | through the service "
                "(Ray Train worker → channel actor → store) | service / plain (median of pairs) | each pair | "
                "training thread CPU per step: plain → service (medians) | service / plain, each pair | "
                "whole process CPU per step: plain → service | training thread busy, service / plain: "
                "median (each pair) |")
    rows.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def med(every: int, key: str) -> float:
        return statistics.median(rates[(every, key)])

    for every in (10, 100):
        pairs = ", ".join(f"{r:.2f}" for r in rates[(every, "ratio")])
        cpu_pairs = ", ".join(f"{r:.2f}" for r in rates[(every, "loop cpu")])
        rows.append(f"| {every} steps | {med(every, 'plain'):.1f} steps/s | {med(every, 'service'):.1f} steps/s | "
                    f"{med(every, 'ratio'):.2f} | {pairs} | {med(every, 'plain loop ms'):.2f} → "
                    f"{med(every, 'loop ms'):.2f} ms | {cpu_pairs} | {med(every, 'plain proc ms'):.2f} → "
                    f"{med(every, 'proc ms'):.2f} ms | {med(every, 'busy'):.2f} ("
                    + ", ".join(f"{r:.2f}" for r in rates[(every, "busy")]) + ") |")
    rows.append(f"\n({steps} steps each, {repeats} interleaved pairs per interval; rates from the first to the last "
                "step, start-up excluded.)\n")


def stall(root: Path, steps: int, every: int, rows: list[str]) -> None:
    """The >= 50 MB model's stall per checkpoint beside its copy to host memory, through the service and plain."""
    doc = big_recipe("bench-stall", max_steps=steps, every=every)
    measured: dict[str, dict[str, float]] = {}
    state, events, wall = through_service(doc, root / "stall-service")
    assert state == "succeeded", f"stall run ended {state}"
    measured["through the service"] = stalls(events, every)
    measured["plain process"] = stalls(plain_events(doc, root / "stall-plain"), every)
    rows.append("| where | state size | checkpoints | ordinary step | copy to host (`copy_s`) | loop stall in `save` "
                "(`stall_s`) | stall / copy | checkpoint step's extra time (outside view) | background write "
                "(`write_s`) |")
    rows.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for where, m in measured.items():
        rows.append(f"| {where} | {m['mb']:.1f} MB | {int(m['n'])} | {m['step_s'] * 1e3:.0f} ms | "
                    f"{m['copy_s'] * 1e3:.1f} ms | {m['stall_s'] * 1e3:.1f} ms | {m['stall_s'] / m['copy_s']:.2f} | "
                    f"{m['outside_s'] * 1e3:.1f} ms | {m['write_s'] * 1e3:.0f} ms |")
        print(f"  stall, {where}: {m}", file=sys.stderr)
    rows.append(f"\n({steps} steps, a checkpoint every {every}; medians over the checkpoints but the last, which "
                f"the attempt's end drains; service run wall {wall:.1f} s.)\n")


def recovery(root: Path, repeats: int, rows: list[str]) -> None:
    """Divergence → the next attempt's first step, in place and with a full worker-group restart."""
    gaps: dict[str, list[float]] = {"in place": [], "full restart": []}
    walls: dict[str, list[float]] = {"in place": [], "full restart": []}
    for i in range(repeats):
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="recovery,throughput,stall",
                        help="Comma-separated: recovery, throughput, stall.")
    parser.add_argument("--repeats", type=int, default=2, help="Runs per recovery mode.")
    parser.add_argument("--steps", type=int, default=2000, help="Steps of the throughput recipe.")
    parser.add_argument("--throughput-repeats", type=int, default=3,
                        help="Interleaved service/plain pairs per checkpoint interval.")
    parser.add_argument("--stall-steps", type=int, default=200, help="Steps of the >= 50 MB model.")
    parser.add_argument("--stall-every", type=int, default=40, help="Its checkpoint interval.")
    parser.add_argument("--plain-child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.plain_child is not None:
        plain_child(args.plain_child)
        return
    parts = set(args.parts.split(","))

    import ray

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    rows: list[str] = []
    try:
        with tempfile.TemporaryDirectory(prefix="ballast-bench-") as tmp:
            root = Path(tmp)
            if "recovery" in parts:
                recovery(root, args.repeats, rows)
            if "throughput" in parts:
                throughput(root, args.steps, args.throughput_repeats, rows)
            if "stall" in parts:
                stall(root, args.stall_steps, args.stall_every, rows)
    finally:
        ray.shutdown()
    print("\n".join(rows))


if __name__ == "__main__":
    main()
