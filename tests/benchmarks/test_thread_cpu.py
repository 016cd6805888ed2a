"""``benchmarks/bench_recovery.py``'s ``ThreadCpu``: per-thread CPU from ``/proc``, turned into CPU per step."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from benchmarks.bench_recovery import ThreadCpu

# spin for 1 s of CPU, then idle for a second so that the sampler sees the final figure however late it runs
SPIN = ("import sys, time\nt = time.process_time()\nwhile time.process_time() - t < float(sys.argv[1]): pass\n"
        "time.sleep(1.0)\n")


def test_per_step_takes_the_cpu_between_samples_over_the_steps_run_between_them() -> None:
    cpu = ThreadCpu("unused")
    # thread 1 busy (1 s of CPU per wall second), thread 2 at a quarter; steps at 100/s from t = 10
    cpu.samples = [(t, {1: t - 10.0, 2: (t - 10.0) / 4}) for t in (9.0, 10.5, 11.0, 12.0, 13.5, 20.0)]
    stamped = [(step, 10.0 + step / 100) for step in range(400)]
    loop, whole = cpu.per_step(stamped)
    # only the samples inside the steps' span (10.5 and 13.5): 3 s of CPU over the 300 steps between them
    assert loop == pytest.approx(0.01)
    assert whole == pytest.approx(0.0125)


def test_samples_the_threads_of_the_marked_process_only() -> None:
    marker = f"thread-cpu-test-{time.monotonic_ns()}"
    with ThreadCpu(marker, interval=0.05) as cpu:
        subprocess.run([sys.executable, "-c", SPIN, "1.0", marker], check=True)
    seen = [threads for _, threads in cpu.samples if threads]
    assert seen, "the marked process was never seen"
    assert len(seen[-1]) == 1  # the spinning child's one thread; nothing of this process or any other
    assert 0.99 <= max(seen[-1].values()) <= 1.5  # it spun for 1 s of its own CPU (plus the interpreter's start)
