"""The CUDA paths, checked in one prepared run on a lent GPU machine (issue 14): bf16 and fp16 autocast (a real fp16
overflow included), NCCL, FSDP with an in-place rollback, and the checkpoint stall on a model of >= 1 GB of state.

Every part runs the real engine (``workers.entry.run_attempt``, the plain-process mode that ``ballast train`` and
the engine tests use) on ``cuda``, and prints one JSON line; a part that fails prints its error and the others
still run. The figures go to BENCHMARKS.md.

    python3 benchmarks/gpu_check.py [--parts env,precision,fsdp,stall] [--out gpu.json]
    python3 benchmarks/gpu_check.py --dry-run     # the same parts on the CPU at toy sizes, gloo for NCCL: checks
                                                  # the script on a machine without a GPU; its figures mean nothing

It needs only torch, pydantic and pyyaml (no Ray, no database). The device image has torch and pyyaml but not
pydantic: carry its wheels as the device README says (``pydantic``, ``pydantic-core``, ``annotated-types``,
``typing-inspection`` for the device's Python, ``pip download --no-deps --only-binary=:all: --python-version 3.12``)
and install them there first.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from contracts.recipe import validate_recipe_data  # noqa: E402
from contracts.wire import AttemptSpec  # noqa: E402
from workers.entry import run_attempt  # noqa: E402
from workers.sinks import ListSink  # noqa: E402


class StampedSink(ListSink):
    """Every event with its wall-clock time; optionally hands back one in-place plan after a divergence."""

    def __init__(self, plan: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.plan = plan

    def emit(self, type: str, data: dict[str, Any]) -> None:
        super().emit(type, data)
        self.events[-1]["ts"] = time.perf_counter()

    def request_plan(self, end_data: dict[str, Any]) -> dict[str, Any] | None:
        if self.plan is None or end_data.get("outcome") != "diverged" or len(self.of_type("end")) > 1:
            return None
        return self.plan


# The 118 M-parameter model has one transient x10 gradient spike on its loss plateau on the H200: at step ~40 at lr
# 3e-4, ~60 at 1e-4 (the trace part; BENCHMARKS.md, "The CUDA paths"). The FSDP part, whose detector rolls back on
# a spike, checks mechanics, so it trains at 1e-4 for 60 steps; the stall part records only.
STABLE_LR = 1e-4


def gpt(d_model: int, layers: int, *, vocab: int, context: int) -> dict[str, Any]:
    return {"name": "tiny_gpt", "vocab_size": vocab, "context": context, "n_layers": layers,
            "n_heads": max(1, d_model // 64), "d_model": d_model}


def recipe(name: str, model: dict[str, Any], *, steps: int, batch: int, lr: float = 3e-4,
           **sections: Any) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": name,
        "model": model,
        "data": {"name": "markov", "vocab_size": model["vocab_size"], "seq_len": model["context"]},
        "training": {"max_steps": steps, "batch_size": batch, "seed": 0},
        "optimizer": {"name": "adamw", "lr": lr},
        "schedule": {"warmup_steps": 10, "decay": "constant"},
        "checkpoint": {"every_steps": 10_000},
        "success": {"min_progress": 0.0, "early_min_progress": 0.0},  # mechanics and speed, not learning
        "resources": {"use_gpu": True, "gpus_per_worker": 1},
    }
    doc.update(sections)
    return doc


def attempt(doc: dict[str, Any], home: Path, sink: StampedSink) -> dict[str, Any]:
    outcome = run_attempt(AttemptSpec(recipe=validate_recipe_data(doc), checkpoint_dir=str(home)), sink)
    metrics = [e for e in sink.events if e["type"] == "metric"]
    stamped = sorted((e["data"]["step"], e["ts"]) for e in metrics)
    half = stamped[len(stamped) // 2:]  # past warm-up and compilation
    rate = (half[-1][0] - half[0][0]) / (half[-1][1] - half[0][1]) if len(half) > 1 else None
    return {
        "outcome": outcome.outcome, "final_step": outcome.final_step, "steps_per_s": rate,
        "final_loss": next((e["data"]["loss"] for e in reversed(metrics) if e["data"]["loss"] is not None), None),
        "skipped_steps": sum(1 for e in metrics if e["data"].get("skipped")),
        "loss_scales": sorted({e["data"]["loss_scale"] for e in metrics if e["data"].get("loss_scale")}),
        "anomalies": [(e["data"]["step"], e["data"]["kind"]) for e in sink.events if e["type"] == "anomaly"],
        "attempts": len(sink.of_type("end")),
    }


# ------------------------------------------------------------------------------------------------------ parts
def part_env(dry: bool) -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available()}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out |= {"device": props.name, "memory_gib": round(props.total_memory / 2**30, 1),
                "capability": list(torch.cuda.get_device_capability(0)), "cuda": torch.version.cuda,
                "nccl": ".".join(map(str, torch.cuda.nccl.version())),  # type: ignore[no-untyped-call]
                "bf16": torch.cuda.is_bf16_supported()}
    elif not dry:
        raise RuntimeError("no CUDA device (use --dry-run to check the script on the CPU)")
    return out


def part_precision(dry: bool) -> dict[str, Any]:
    """fp32, bf16 and fp16 side by side (steps/s, final loss), then fp16 with every gradient x1e38 at one step:
    scaled by the loss scale that overflows even fp32, which the dynamic loss scale must absorb (the step skipped,
    the scale backed off, the run not rolled back)."""
    model = gpt(64, 2, vocab=64, context=32) if dry else gpt(1024, 12, vocab=8192, context=512)
    steps, batch = (30, 4) if dry else (200, 16)
    out: dict[str, Any] = {}
    dtypes = ("fp32", "bf16", "fp16")
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes:
            doc = recipe(f"gpu-{dtype}", model, steps=steps, batch=batch, precision={"dtype": dtype})
            out[dtype] = attempt(doc, Path(tmp) / dtype, StampedSink())
        doc = recipe("gpu-fp16-overflow", model, steps=steps, batch=batch, precision={"dtype": "fp16"},
                     faults=[{"type": "grad_scale", "step": steps // 2, "factor": 1e38}])
        out["fp16_overflow"] = attempt(doc, Path(tmp) / "overflow", StampedSink())
    base = out["fp32"]["steps_per_s"]
    for dtype in dtypes:
        if base and out[dtype]["steps_per_s"]:
            out[dtype]["speed_vs_fp32"] = out[dtype]["steps_per_s"] / base
    return out


def part_fsdp(dry: bool) -> dict[str, Any]:
    """FSDP2 over an NCCL process group (world size 1 on one GPU: the sharding, the collectives and the sharded
    checkpoint path run, though nothing is split), bf16; every gradient x1e4 at step 30 diverges the attempt and
    the sink hands back an in-place plan from the step-20 checkpoint with the LR halved; the run must finish."""
    backend = "gloo" if dry else "nccl"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        if not dry:
            torch.cuda.set_device(0)
        model = gpt(64, 2, vocab=64, context=32) if dry else gpt(1024, 8, vocab=8192, context=256)
        with tempfile.TemporaryDirectory() as tmp:
            home = Path(tmp)
            doc = recipe("gpu-fsdp", model, steps=60, batch=4 if dry else 16, lr=STABLE_LR,
                         precision={"dtype": "bf16"}, distributed={"strategy": "fsdp"},
                         checkpoint={"every_steps": 10}, detectors={"grad_norm_spike": {"action": "rollback"}},
                         clipping={"method": "none"},
                         faults=[{"type": "grad_scale", "step": 30, "factor": 1e4, "attempt": 1}])
            plan = {"attempt": 2, "resume_from": str(home / "step_00000020"), "rewarm_steps": 5, "data_offset": 0,
                    "overrides": {"optimizer.lr": [STABLE_LR, STABLE_LR / 2]}}
            result = attempt(doc, home, StampedSink(plan))
            result["checkpoints"] = sorted(p.name for p in home.iterdir() if p.name.startswith("step_"))
        probe = torch.ones(4, device="cpu" if dry else "cuda")
        dist.all_reduce(probe)
        result["all_reduce_ok"] = bool(probe.sum().item() == 4.0)
        return result
    finally:
        dist.destroy_process_group()


def part_stall(dry: bool) -> dict[str, Any]:
    """The loop's stall per checkpoint (``timing.stall_s``: its whole time in ``save``) against the copy of the
    state to host memory (``timing.copy_s``), on a model whose weights and AdamW moments are >= 1 GB; medians over
    the checkpoints after the first (which allocates the pinned buffers) but the last (the attempt's end drains
    it). Checkpoints are further apart than one write takes (~5 s for 1.41 GB on the H200 machine's disk): closer
    ones wait for the previous write by design (one write in flight). Target: stall <= 1.5x copy. Also the steps/s
    with those checkpoints against the same run without any. Detectors record only: mechanics, not learning."""
    model = gpt(64, 2, vocab=64, context=32) if dry else gpt(1024, 8, vocab=8192, context=256)
    every = 10 if dry else 300
    result: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, interval in (("checkpointed", every), ("no_checkpoints", 10_000_000)):
            sink = StampedSink()
            doc = recipe(f"gpu-stall-{label}", model, steps=every * 5, batch=4 if dry else 8, lr=STABLE_LR,
                         precision={"dtype": "bf16"}, checkpoint={"every_steps": interval, "keep": 2},
                         detectors=RECORD_ONLY)
            result[label] = attempt(doc, Path(tmp) / label, sink)
            if label == "checkpointed":
                checkpoints = sorted((e["data"] for e in sink.events if e["type"] == "checkpoint"),
                                     key=lambda c: c["step"])
    result["checkpoint_timing"] = [
        {"step": c["step"], **{k: round(v, 3) for k, v in c["timing"].items()}} for c in checkpoints]
    timed = [c["timing"] for c in checkpoints[1:-1]] or [c["timing"] for c in checkpoints]
    result |= {
        "state_gb": statistics.median(t["bytes"] for t in timed) / 1e9,
        "copy_s": statistics.median(t["copy_s"] for t in timed),
        "stall_s": statistics.median(t["stall_s"] for t in timed),
        "write_s": statistics.median(t["write_s"] for t in timed),
    }
    result["stall_over_copy"] = result["stall_s"] / result["copy_s"] if result["copy_s"] else None
    rates = result["checkpointed"]["steps_per_s"], result["no_checkpoints"]["steps_per_s"]
    result["steps_per_s_ratio"] = rates[0] / rates[1] if all(rates) else None
    return result


RECORD_ONLY = {name: {"action": "record"} for name in ("nonfinite", "grad_norm_spike", "loss_spike")}


def part_trace(dry: bool) -> dict[str, Any]:
    """The stall part's model with every detector recording only, step by step: does it train or diverge on its
    own (lr 1e-4 and 3e-4, no checkpoints), and does checkpointing every 20 steps change its numbers (lr 1e-4,
    the same seed)? Also the stall of those checkpoints with no rollback cutting the run short."""
    model = gpt(64, 2, vocab=64, context=32) if dry else gpt(1024, 8, vocab=8192, context=256)
    steps, batch = (40, 4) if dry else (100, 8)
    out: dict[str, Any] = {}
    runs = {"lr1e-4": (1e-4, 10_000), "lr1e-4_ckpt20": (1e-4, 20), "lr3e-4": (3e-4, 10_000)}
    with tempfile.TemporaryDirectory() as tmp:
        for label, (lr, every) in runs.items():
            sink = StampedSink()
            doc = recipe(f"gpu-trace-{label}", model, steps=steps, batch=batch, lr=lr, precision={"dtype": "bf16"},
                         checkpoint={"every_steps": every, "keep": 2}, detectors=RECORD_ONLY)
            result = attempt(doc, Path(tmp) / label, sink)
            metrics = sorted((e["data"] for e in sink.events if e["type"] == "metric"), key=lambda m: m["step"])
            result["loss"] = [None if m["loss"] is None else round(m["loss"], 4) for m in metrics]
            result["grad_norm"] = [None if m["grad_norm"] is None else round(m["grad_norm"], 4) for m in metrics]
            result["checkpoint_timing"] = [
                {"step": e["data"]["step"], **{k: round(v, 3) for k, v in e["data"]["timing"].items()}}
                for e in sink.events if e["type"] == "checkpoint"]
            out[label] = result
    a, b = out["lr1e-4"]["loss"], out["lr1e-4_ckpt20"]["loss"]
    out["max_abs_loss_diff_ckpt_vs_none"] = max(
        (abs(x - y) for x, y in zip(a, b, strict=False) if x is not None and y is not None), default=None)
    return out


PARTS: dict[str, Callable[[bool], dict[str, Any]]] = {
    "env": part_env, "precision": part_precision, "fsdp": part_fsdp, "stall": part_stall, "trace": part_trace,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    ap.add_argument("--dry-run", action="store_true", help="on the CPU at toy sizes (checks the script only)")
    ap.add_argument("--out", type=Path, default=None, help="also write every part's result here as JSON")
    args = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, as the engine asks
    results: dict[str, Any] = {}
    failed = False
    for name in args.parts.split(","):
        started = time.perf_counter()
        try:
            results[name] = PARTS[name](args.dry_run)
        except Exception as exc:  # noqa: BLE001 - one failing part must not hide the others
            failed = True
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        results[name]["wall_s"] = round(time.perf_counter() - started, 1)
        print(json.dumps({name: results[name]}, default=str), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
