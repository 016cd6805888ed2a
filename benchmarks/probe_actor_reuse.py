"""Does Ray hand a warm process to a new actor? The probe behind the start-latency floor in BENCHMARKS.md.

A local Ray (``num_cpus=2``, torch preloaded into its worker processes, as ``RayLauncher.connect`` does) creates,
uses and kills an actor four times, with two no-op tasks between rounds (idle workers of the same
``runtime_env``), and prints how long each actor took to answer and how old its process was. A warm process
answers in well under a second and is older than that; a cold one's age is about its start time.

``--mode plain``: no ``runtime_env`` anywhere. ``--mode job``: a job-level ``runtime_env`` whose ``env_vars`` are
those Ray Train gives its controller and workers. ``--mode job-opt``: the same, and the actor asks for that
``runtime_env`` itself, as Ray Train's actors do.

Usage: ``python benchmarks/probe_actor_reuse.py [--mode plain|job|job-opt]``.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import ray


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", choices=("plain", "job", "job-opt"), default="plain")
    parser.add_argument("--rounds", type=int, default=4)
    args = parser.parse_args()

    os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.25")
    os.environ.setdefault("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
    from ray.train.v2._internal.constants import get_env_vars_to_propagate

    env = get_env_vars_to_propagate()
    init: dict[str, Any] = {"runtime_env": {"env_vars": env}} if args.mode != "plain" else {}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _system_config={"preload_python_modules": ["torch"]}, **init)
    time.sleep(6)  # the prestarted workers import torch

    @ray.remote(num_cpus=0)
    class Probe:
        def age(self) -> tuple[int, float]:
            import psutil

            return os.getpid(), time.time() - psutil.Process().create_time()

    @ray.remote(num_cpus=0)
    def idle() -> int:
        time.sleep(0.5)
        return os.getpid()

    for i in range(args.rounds):
        started = time.time()
        actor = (Probe.options(runtime_env={"env_vars": env}) if args.mode == "job-opt" else Probe).remote()
        pid, age = ray.get(actor.age.remote())
        print(f"{args.mode} round {i}: actor answered after {time.time() - started:.2f} s, pid {pid}, "
              f"process age {age:.1f} s", flush=True)
        ray.kill(actor)
        print(f"  idle task workers: {sorted(ray.get([idle.remote() for _ in range(2)]))}", flush=True)
        time.sleep(6)
    ray.shutdown()


if __name__ == "__main__":
    main()
