"""Overhead of the guarded loop: steps/s of ``GuardedTrainer.train_step`` vs a bare loop, side by side.

Both loops train the same model (same initialisation) on the same batches (``DataSource.batch(step)``) with the
same AdamW. The bare loop does only forward, backward, ``clip_grad_norm_`` and ``optimizer.step()``. The guarded
loop does everything a real attempt does per step (LR schedule, loss scaler, fused grad norms, clipping, the
signals gather with its one host sync, the detectors, telemetry dicts to a sink) and per-layer statistics every
``--layer-stats-every`` steps; checkpoints are left out (their cost depends on the disk, not on the loop).

The two loops are interleaved in short blocks (guarded, bare, guarded, bare, ...) so that noise from other
processes hits both alike; the reported ratio is the median of the per-round ratios, on this process's CPU time
(robust on a shared machine) and on wall time.

    python benchmarks/bench_engine.py                    # tiny_gpt d_model 128, 4 layers, batch 16 x 64 tokens
    python benchmarks/bench_engine.py --d-model 64 --layers 2 --seq-len 32 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from typing import Any

import torch

from contracts.recipe import Recipe
from contracts.wire import AttemptSpec
from workers.context import WorkerContext
from workers.data import build_data
from workers.models import build_model
from workers.trainer import GuardedTrainer


class NullSink:
    """Receives the telemetry (so building the event dicts is measured) and drops it."""

    def __init__(self) -> None:
        self.count = 0

    def emit(self, type: str, data: dict[str, Any]) -> None:
        self.count += 1

    def flush(self) -> None:
        return None

    def should_stop(self) -> bool:
        return False


def make_recipe(args: argparse.Namespace) -> Recipe:
    return Recipe.model_validate({
        "name": "bench-engine",
        "model": {"name": "tiny_gpt", "vocab_size": 256, "context": args.seq_len, "n_layers": args.layers,
                  "n_heads": 4, "d_model": args.d_model},
        "data": {"name": "markov", "vocab_size": 256, "seq_len": args.seq_len, "branching": 8},
        "training": {"max_steps": 1_000_000, "batch_size": args.batch_size, "seed": 0},
        "optimizer": {"name": "adamw", "lr": 1e-3},
        "schedule": {"warmup_steps": 100},
        "clipping": {"method": "global_norm", "max_norm": 1.0},
        "telemetry": {"layer_stats_every": args.layer_stats_every},
    })


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--layer-stats-every", type=int, default=10)
    parser.add_argument("--block", type=int, default=10, help="steps per loop per round")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="untimed steps of each loop first")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: stable numbers)")
    parser.add_argument("--json", dest="json_out", help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    recipe = make_recipe(args)
    with tempfile.TemporaryDirectory() as tmp:
        sink = NullSink()
        guarded = GuardedTrainer(AttemptSpec(recipe=recipe, checkpoint_dir=tmp), WorkerContext(), sink)

        data = build_data(recipe.data, seed=0, batch_size=args.batch_size)
        bare_model = build_model(recipe.model, data, seed=0)
        bare_opt = torch.optim.AdamW(bare_model.parameters(), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
        bare_step = 0

        def bare(n: int) -> None:
            nonlocal bare_step
            for _ in range(n):
                loss = bare_model(data.batch(bare_step))
                loss.backward()
                torch.nn.utils.clip_grad_norm_(bare_model.parameters(), 1.0)
                bare_opt.step()
                bare_opt.zero_grad(set_to_none=True)
                bare_step += 1

        guarded_step = 0

        def guard(n: int) -> None:
            nonlocal guarded_step
            for _ in range(n):
                guarded.train_step(guarded_step)
                guarded_step += 1

        guard(args.warmup)
        bare(args.warmup)
        # CPU time of this process (one torch thread) is what the loop costs; wall time also counts other
        # processes on a shared machine, so both are reported and the CPU-time ratio is the headline
        wall: dict[str, list[float]] = {"guarded": [], "bare": []}
        cpu: dict[str, list[float]] = {"guarded": [], "bare": []}
        for _ in range(args.rounds):
            for name, fn in (("guarded", guard), ("bare", bare)):
                w0, c0 = time.perf_counter(), time.process_time()
                fn(args.block)
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)

    def summary(times: dict[str, list[float]]) -> dict[str, float]:
        ratios = [b / g for g, b in zip(times["guarded"], times["bare"], strict=True)]
        return {
            "guarded_steps_per_s": args.block * args.rounds / sum(times["guarded"]),
            "bare_steps_per_s": args.block * args.rounds / sum(times["bare"]),
            "ratio_median": statistics.median(ratios),
            "ratio_p25": statistics.quantiles(ratios, n=4)[0],
            "ratio_p75": statistics.quantiles(ratios, n=4)[2],
        }

    result: dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items() if k != "json_out"},
        "torch": torch.__version__,
        "cpu_time": summary(cpu),
        "wall_time": summary(wall),
        "events_emitted": sink.count,
    }
    c, w = result["cpu_time"], result["wall_time"]
    print(f"tiny_gpt d_model {args.d_model}, {args.layers} layers, batch {args.batch_size} x {args.seq_len} tokens, "
          f"{args.threads} thread(s), layer stats every {args.layer_stats_every} steps, "
          f"{args.rounds} rounds of {args.block} steps per loop\n")
    print("| clock | bare steps/s | guarded steps/s | guarded / bare (median round) | p25–p75 |")
    print("| --- | --- | --- | --- | --- |")
    for label, m in (("CPU time", c), ("wall time", w)):
        print(f"| {label} | {m['bare_steps_per_s']:.1f} | {m['guarded_steps_per_s']:.1f} | {m['ratio_median']:.3f} | "
              f"{m['ratio_p25']:.3f}–{m['ratio_p75']:.3f} |")
    if args.json_out:
        with open(args.json_out, "w") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
