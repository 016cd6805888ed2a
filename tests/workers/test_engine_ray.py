"""The guarded loop as the per-worker function of a 2-worker Ray Train run (DDP over gloo on CPU).

Two fits share the session's Ray instance:
A. 100 steps from scratch; at step 99 the gradients of rank 1 *only* are multiplied by 1e4 and the grad-norm
   spike detector's action is rollback. If the ranks decided differently, rank 1 would leave the loop while
   rank 0 waited in the next collective: a deadlock (the pytest timeout turns it into a failure).
B. Attempt 2 (the fault fires only in attempt 1) resumed from A's step-50 checkpoint: its losses for steps
   50..99 must equal A's exactly; its final checkpoint then resumes in a plain process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contracts.wire import AttemptSpec
from tests.recipes import build_recipe
from workers.checkpoint import load_checkpoint
from workers.entry import run_attempt, train_loop_per_worker

pytestmark = [pytest.mark.ray]

RECIPE: dict[str, Any] = {
    "name": "ray-engine-test",
    "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 2, "n_heads": 2, "d_model": 32},
    "data": {"name": "markov", "vocab_size": 32, "seq_len": 16},
    "training": {"max_steps": 100, "batch_size": 8, "seed": 1, "deterministic": True},
    "optimizer": {"name": "adamw", "lr": 3e-3},
    "schedule": {"warmup_steps": 10},
    "checkpoint": {"every_steps": 50},
    "telemetry": {"layer_stats_every": 10},
    "resources": {"num_workers": 2},
    "recovery": {"in_place": False},
    "detectors": {"grad_norm_spike": {"action": "rollback"}},
    "faults": [{"type": "grad_scale", "step": 99, "factor": 1e4, "rank": 1, "attempt": 1}],
}


def _collector() -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class Collector:
        """Stands in for the orchestrator's channel: keeps what rank 0's sink pushes."""

        def __init__(self) -> None:
            self.events: list[dict[str, Any]] = []

        def push(self, batch: list[dict[str, Any]]) -> None:
            self.events.extend(batch)

        def should_stop(self) -> bool:
            return False

        def register_worker(self, info: dict[str, Any]) -> None:
            return None

        def all(self) -> list[dict[str, Any]]:
            return self.events

    return Collector.remote()  # type: ignore[attr-defined]


def _fit(tmp_path: Path, name: str, spec: AttemptSpec) -> list[dict[str, Any]]:
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from workers.ray_sink import ActorSink

    collector = _collector()
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config={
            "spec": spec.to_dict(),
            "sink": ActorSink(collector, attempt=spec.attempt),
            "checkpoint_uri_prefix": str(tmp_path / name),
        },
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=0)),
    )
    trainer.fit()
    events: list[dict[str, Any]] = ray.get(collector.all.remote())
    ray.kill(collector)
    return events


def _of(events: list[dict[str, Any]], type: str) -> list[dict[str, Any]]:
    return [e["data"] for e in events if e["type"] == type]


@pytest.mark.timeout(420)
def test_two_workers_agree_resume_exactly_and_checkpoints_load_in_plain_process(
    ray_cluster: Any, tmp_path: Path
) -> None:
    recipe = build_recipe(RECIPE)

    # A: a fault on rank 1 only; both ranks must take the same rollback decision at step 99
    a = _fit(tmp_path, "a", AttemptSpec(recipe=recipe, checkpoint_dir=str(tmp_path / "scratch")))
    (end_a,) = _of(a, "end")
    assert end_a["outcome"] == "diverged" and end_a["onset_step"] == 99 and end_a["detector"] == "grad_norm_spike"
    (anomaly,) = _of(a, "anomaly")
    assert anomaly["step"] == 99 and anomaly["rank"] == 1 and anomaly["action"] == "rollback"
    metrics_a = _of(a, "metric")
    assert [m["step"] for m in metrics_a] == list(range(100))
    (ckpt50,) = _of(a, "checkpoint")
    assert ckpt50["step"] == 50 and ckpt50["healthy"] and Path(ckpt50["uri"]).is_dir()
    assert [e["seq"] for e in a] == list(range(1, len(a) + 1))

    # B: attempt 2 resumes from A's step 50 through Ray Train and replays steps 50..99 exactly
    b = _fit(tmp_path, "b", AttemptSpec(recipe=recipe, checkpoint_dir=str(tmp_path / "scratch"), attempt=2,
                                        resume_from=ckpt50["uri"]))
    (end_b,) = _of(b, "end")
    assert end_b["outcome"] == "succeeded" and end_b["final_step"] == 100
    metrics_b = _of(b, "metric")
    assert [m["step"] for m in metrics_b] == list(range(50, 100))
    assert [m["loss"] for m in metrics_b] == [m["loss"] for m in metrics_a[50:]]
    (ckpt100,) = _of(b, "checkpoint")
    assert ckpt100["step"] == 100 and ckpt100["uri"] == str(tmp_path / "b" / "step_00000100")

    # the 2-worker checkpoint loads and trains on in a plain process (world size 1)
    state, manifest = load_checkpoint(ckpt100["uri"], expected_sha256=ckpt100["sha256"])
    assert manifest.step == 100 and manifest.healthy and len(state["rng"]) == 2
    plain = build_recipe(RECIPE, resources={"num_workers": 1}, faults=[], training={"max_steps": 105})
    res = run_attempt(AttemptSpec(recipe=plain, checkpoint_dir=str(tmp_path / "plain"), resume_from=ckpt100["uri"]))
    assert res.outcome == "succeeded" and res.start_step == 100 and len(res.losses) == 5
