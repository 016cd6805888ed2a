"""How much of the background checkpoint write holds the GIL (issue 14, item 1, on GPUs).

On an H200 a loop of ~38 small steps/s ran at 0.83x its speed while a 1.41 GB checkpoint was written every 300
steps, though its own stall per checkpoint was 0.03 s (BENCHMARKS.md, "The CUDA paths"). A loop bound by Python
launching kernels slows when another thread holds the GIL, whatever the free cores. This probe runs each phase of
the real background job (``workers.checkpoint.encode_checkpoint``, ``write_checkpoint``,
``contracts.checkpoint.verify_checkpoint``) on a thread while the main thread spins, and reports the time the
main thread could not run (gaps over 5 ms between its iterations). Run it on a quiet machine: on a loaded one the
scheduler's own preemptions count as gaps too.

    python benchmarks/probe_writer_gil.py [--mb 400] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from contracts.checkpoint import verify_checkpoint  # noqa: E402
from contracts.storage import Location  # noqa: E402
from workers.checkpoint import EncodedCheckpoint, encode_checkpoint, write_checkpoint  # noqa: E402
from workers.checkpoint_writer import to_host  # noqa: E402

GAP_S = 0.005


def blocked(job: Callable[[], Any]) -> tuple[float, float, float]:
    """(wall seconds of ``job`` on a thread, seconds the spinning main thread was held up meanwhile in gaps over
    5 ms, the main thread's iterations per second meanwhile)."""
    done = threading.Event()

    def run() -> None:
        try:
            job()
        finally:
            done.set()

    thread = threading.Thread(target=run)
    started = last = time.perf_counter()
    thread.start()
    held = 0.0
    spins = 0
    while not done.is_set():
        now = time.perf_counter()
        if now - last > GAP_S:
            held += now - last
        last = now
        spins += 1
    thread.join()
    wall = time.perf_counter() - started
    return wall, held, spins / wall


def state_of(mb: int) -> dict[str, Any]:
    """A weights-and-moments state of ~``mb`` MB in tensors of a transformer's sizes (1024-wide blocks)."""
    gen = torch.Generator().manual_seed(0)
    per = 4 * 1024 * 1024 * 4 * 3  # one block: 4 fp32 (1024 x 1024) matrices, their weights and two moments
    blocks = max(1, mb * 2**20 // per)
    model = {f"blocks.{i}.w{j}": torch.randn(1024, 1024, generator=gen) for i in range(blocks) for j in range(4)}
    moments = {f"{k}.{m}": torch.randn(1024, 1024, generator=gen) for k in model for m in ("exp_avg", "exp_avg_sq")}
    return {"model": model, "optimizer": moments, "progress": {"step": 1}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mb", type=int, default=400)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    snapshot = to_host(state_of(args.mb))
    size = sum(t.numel() * t.element_size() for part in ("model", "optimizer") for t in snapshot[part].values())
    print(f"state: {size / 1e6:.0f} MB in {len(snapshot['model']) + len(snapshot['optimizer'])} tensors")
    rows: dict[str, list[tuple[float, float, float]]] = {"idle": [], "encode": [], "write": [], "verify": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            rows["idle"].append(blocked(lambda: time.sleep(1.0)))
            where = Location(Path(tmp) / f"step_{i:08d}")
            box: list[EncodedCheckpoint] = []
            meta = {"step": i, "healthy": True}
            rows["encode"].append(blocked(lambda: box.append(encode_checkpoint(snapshot, meta))))  # noqa: B023
            encoded = box[0]
            rows["write"].append(blocked(lambda: write_checkpoint(where, encoded)))  # noqa: B023
            rows["verify"].append(blocked(lambda: verify_checkpoint(where, expected_sha256=encoded.sha256)))  # noqa: B023
    idle = statistics.median(r for _, _, r in rows["idle"])
    print("| phase | wall (median) | main thread held up (gaps > 5 ms) | share | main thread's speed ÷ idle |")
    print("| --- | --- | --- | --- | --- |")
    for phase, got in rows.items():
        wall = statistics.median(w for w, _, _ in got)
        held = statistics.median(h for _, h, _ in got)
        speed = statistics.median(r for _, _, r in got) / idle
        print(f"| {phase} | {wall:.2f} s | {held:.2f} s | {held / wall:.0%} | {speed:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
