"""Held-out evaluation in the guarded loop: when it runs, what it emits, that it leaves the training trajectory
bit-identical, that its history resumes with the checkpoint, and that the outcome verdict reads it."""

from __future__ import annotations

import math
import random
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from contracts.wire import AttemptSpec
from tests.recipes import build_recipe
from workers.context import WorkerContext
from workers.evaluation import EvalHistory, eval_due
from workers.sinks import ListSink
from workers.trainer import GuardedTrainer

BASE: dict[str, Any] = {
    "name": "eval-test",
    "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 2, "n_heads": 2, "d_model": 32},
    "data": {"name": "markov", "vocab_size": 32, "seq_len": 16, "branching": 4},
    "training": {"max_steps": 60, "batch_size": 8, "seed": 0, "eval_interval": 10, "eval_batches": 2},
    "optimizer": {"name": "adamw", "lr": 3e-3},
    "schedule": {"warmup_steps": 10},
    "checkpoint": {"every_steps": 20},
    "success": {"min_progress": 0.0, "early_min_progress": 0.0},
}
make_recipe = partial(build_recipe, BASE)


def trainer(tmp_path: Path, sink: ListSink | None = None, resume_dir: str | None = None,
            **sections: Any) -> GuardedTrainer:
    spec = AttemptSpec(recipe=make_recipe(**sections), checkpoint_dir=str(tmp_path / "ckpt"))
    return GuardedTrainer(spec, WorkerContext(), sink, resume_dir=resume_dir)


def test_eval_due() -> None:
    assert [s for s in range(0, 31) if eval_due(s, 10)] == [0, 10, 20, 30]
    assert not any(eval_due(s, 0) for s in range(30))


def test_eval_events_every_k_steps_at_start_and_end_finite_and_decreasing(tmp_path: Path) -> None:
    sink = ListSink()
    res = trainer(tmp_path, sink).train()
    assert res.outcome == "succeeded", res.reason
    evals = sink.of_type("eval")
    assert [e["step"] for e in evals] == [0, 10, 20, 30, 40, 50, 60]  # the end (60) is a regular one: no repeat
    assert all(e["batches"] == 2 for e in evals)
    values = [e["eval_loss"] for e in evals]
    assert all(v is not None and math.isfinite(v) for v in values)
    assert values[0] == pytest.approx(math.log(32), rel=0.1)  # an untrained model is near chance
    assert values[-1] < values[0] - 0.3 and min(values[3:]) < values[1]
    assert res.evals == evals
    # each eval comes before the checkpoint of its step, which records it
    order = [(e["type"], e["data"]["step"]) for e in sink.events if e["type"] in ("eval", "checkpoint")]
    assert order.index(("eval", 20)) < order.index(("checkpoint", 20))
    by_step = {e["step"]: e["eval_loss"] for e in evals}
    for ck in sink.of_type("checkpoint"):
        assert ck["metrics"]["eval_loss"] == by_step[ck["step"]]
        assert ck["verdict"]["eval_loss"] == by_step[ck["step"]] and ck["verdict"]["eval_regressed"] is False
        assert ck["healthy"]
    assert "eval loss" in res.reason


def test_an_off_schedule_end_is_evaluated_once_before_its_checkpoint(tmp_path: Path) -> None:
    sink = ListSink()
    trainer(tmp_path, sink, training={"max_steps": 17, "eval_interval": 7}).train()
    assert [e["step"] for e in sink.of_type("eval")] == [0, 7, 14, 17]
    [ck] = sink.of_type("checkpoint")
    assert ck["step"] == 17 and ck["metrics"]["eval_loss"] == sink.of_type("eval")[-1]["eval_loss"]


def test_checkpoints_without_a_fresh_eval_carry_none(tmp_path: Path) -> None:
    """An eval from an earlier step did not measure these weights: the checkpoint's verdict does not use it."""
    sink = ListSink()
    trainer(tmp_path, sink, training={"max_steps": 40, "eval_interval": 15}).train()
    assert [e["step"] for e in sink.of_type("eval")] == [0, 15, 30, 40]
    by_step = {c["step"]: c for c in sink.of_type("checkpoint")}
    assert "eval_loss" not in by_step[20]["metrics"] and "eval_regressed" not in by_step[20]["verdict"]
    assert by_step[40]["metrics"]["eval_loss"] is not None


def test_without_eval_interval_nothing_changes_in_events_or_checkpoints(tmp_path: Path) -> None:
    sink = ListSink()
    res = trainer(tmp_path, sink, training={"max_steps": 20, "eval_interval": 0}).train()
    assert sink.of_type("eval") == [] and res.evals == []
    [ck] = sink.of_type("checkpoint")
    assert set(ck["metrics"]) == {"loss", "smoothed_loss"}
    assert "eval_loss" not in ck["verdict"]
    assert not (tmp_path / "ckpt" / "step_00000020" / "evals.pt").exists()


def _weights(t: GuardedTrainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.module.state_dict().items()}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_eval_leaves_the_training_trajectory_bit_identical(tmp_path: Path, dtype: str) -> None:
    """Losses, grad norms and final weights identical with and without eval (eval draws no training randomness
    and no training batch, and leaves the modules in training mode); bf16: eval runs under the same autocast."""
    sections: dict[str, Any] = {"training": {"max_steps": 30, "eval_interval": 5, "deterministic": True},
                                "checkpoint": {"every_steps": 10}, "precision": {"dtype": dtype}}
    with_eval = trainer(tmp_path / "a", **sections)
    a = with_eval.train()
    sections["training"] = {**sections["training"], "eval_interval": 0}
    without = trainer(tmp_path / "b", **sections)
    b = without.train()
    assert len(a.evals) == 7 and b.evals == []
    assert all(e["eval_loss"] is not None for e in a.evals)
    assert a.losses == b.losses and a.grad_norms == b.grad_norms
    wa, wb = _weights(with_eval), _weights(without)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def test_evaluate_restores_rng_and_training_mode_even_when_the_model_draws_randomness(tmp_path: Path) -> None:
    t = trainer(tmp_path)
    original = t.module.forward

    def noisy_forward(batch: Any) -> torch.Tensor:
        torch.rand(3)  # a model that draws from the global RNG (noise injection, sampling) in any mode
        random.random()
        return original(batch)

    t.module.forward = noisy_forward  # type: ignore[method-assign]
    t.module.blocks[0].eval()  # a submodule someone keeps in eval mode stays so
    modes = {n: m.training for n, m in t.module.named_modules()}
    torch_before, py_before = torch.get_rng_state(), random.getstate()
    value = t._evaluate(0)
    assert math.isfinite(value)
    assert torch.equal(torch.get_rng_state(), torch_before) and random.getstate() == py_before
    assert {n: m.training for n, m in t.module.named_modules()} == modes
    assert t._evaluate(0) == value  # the same batches every time: the same number for the same weights


def test_resumed_attempt_continues_the_eval_series_and_its_best(tmp_path: Path) -> None:
    straight_sink = ListSink()
    straight = trainer(tmp_path / "s", straight_sink, training={"max_steps": 40, "deterministic": True}).train()
    ckpt20 = next(c for c in straight.checkpoints if c.step == 20)
    sink = ListSink()
    resumed = trainer(tmp_path / "r", sink, resume_dir=ckpt20.path, training={"max_steps": 40,
                                                                              "deterministic": True})
    assert resumed.evals is not None and resumed.evals.initial == straight_sink.of_type("eval")[0]["eval_loss"]
    resumed.train()
    # the checkpoint's eval measured these weights (it is not repeated), and the rest replays exactly
    assert sink.of_type("eval") == [e for e in straight_sink.of_type("eval") if e["step"] > 20]


def _regressing_eval(t: GuardedTrainer) -> None:
    """Held-out targets that are noise: the sharper the model gets on the training chain, the worse its eval."""
    gen = torch.Generator().manual_seed(7)
    inputs, _ = t.data.eval_batch(0)
    targets = torch.randint(0, 32, inputs.shape, generator=gen)
    t.data.eval_batch = lambda index: (inputs, targets)  # type: ignore[method-assign]


def test_an_eval_loss_that_regresses_while_the_training_loss_learns_is_overfitting(tmp_path: Path) -> None:
    """The held-out batches' targets are random: the better the model fits its training data, the worse it scores
    on them. The training loss fell by more than the tolerance since the eval loss was best: overfitting, with the
    rollback point of an eval regression (the step of the best eval) and the training loss there in the reason."""
    sink = ListSink()
    t = trainer(tmp_path, sink, training={"max_steps": 60}, success={"eval_regression_tolerance": 0.05})
    _regressing_eval(t)
    res = t.train()
    evals = [e["eval_loss"] for e in sink.of_type("eval")]
    assert res.losses[-1] < res.losses[0] - 0.3  # the training loss looks fine
    assert evals[-1] > 1.05 * min(evals)
    assert res.outcome == "diverged" and res.detector == "overfitting", res.reason
    best_step = sink.of_type("eval")[evals.index(min(evals))]["step"]
    assert res.onset_step == best_step
    assert "training loss fell from" in res.reason and (f"at step {best_step})" in res.reason or best_step == 0)
    [finding] = [a for a in sink.of_type("anomaly") if a["detector"] == "verdict"]
    assert finding["kind"] == "overfitting" and "eval loss" in finding["details"]["reason"]
    # the checkpoints measured at a regressed eval are not healthy, so no rollback lands there
    assert not sink.of_type("checkpoint")[-1]["healthy"]


def test_eval_recorded_but_not_judged_when_the_tolerance_is_none(tmp_path: Path) -> None:
    t = trainer(tmp_path, training={"max_steps": 60}, success={"eval_regression_tolerance": None})
    _regressing_eval(t)
    res = t.train()
    assert res.outcome == "succeeded", res.reason
    assert len(res.evals) == 7


def test_eval_history_state_roundtrip() -> None:
    h = EvalHistory()
    assert h.evidence() is None
    h.observe(0, 3.0)
    h.observe(10, 2.0)
    h.observe(20, float("nan"))
    ev = h.evidence()
    assert ev is not None and (ev.initial, ev.best, ev.best_step, ev.final_step) == (3.0, 2.0, 10, 20)
    assert math.isnan(ev.final)
    again = EvalHistory()
    again.load_state_dict(h.state_dict())
    back = again.evidence()
    assert back is not None and (back.initial, back.best, back.best_step, back.final_step) == (3.0, 2.0, 10, 20)
    assert math.isnan(back.final)
    late = EvalHistory()
    late.observe(40, 2.5)  # a lineage first evaluated after updates has no initial eval loss
    assert late.initial is None


def test_ballast_train_prints_eval_losses_and_returns_them(tmp_path: Path) -> None:
    import json

    import yaml
    from typer.testing import CliRunner

    import api.cli  # noqa: F401  (registers the commands)
    from api.cli.app import app
    from tests.recipes import recipe_doc

    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump(recipe_doc(BASE, training={"max_steps": 20, "eval_interval": 10})))
    res = CliRunner().invoke(app, ["train", str(path)])
    assert res.exit_code == 0, res.output
    assert "eval step 10: eval loss" in res.stderr
    assert "eval loss: first " in res.stdout and ", best " in res.stdout
    res = CliRunner().invoke(app, ["train", str(path), "--json"])
    assert res.exit_code == 0, res.output
    assert [e["step"] for e in json.loads(res.stdout)["evals"]] == [0, 10, 20]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_ddp_every_rank_holds_the_same_eval_loss_and_the_same_trajectory(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    script = Path(__file__).with_name("ddp_eval_script.py")
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True,
                          timeout=280, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"results{r}.json").read_text()) for r in (0, 1))
    assert r0["on"]["outcome"] == r0["off"]["outcome"] == "succeeded"
    assert [e["step"] for e in r0["on"]["evals"]] == [0, 5, 10, 12]
    assert all(e["batches"] == 4 and e["eval_loss"] is not None for e in r0["on"]["evals"])  # 2 per rank
    assert r0["on"]["evals"] == r1["on"]["evals"]  # the all-gathered mean: one number on every rank
    assert r0["on"]["losses"] == r0["off"]["losses"] == r1["on"]["losses"]
    [ck12] = [c for c in r0["on"]["checkpoints"] if c["step"] == 12]
    assert ck12["metrics"]["eval_loss"] == r0["on"]["evals"][-1]["eval_loss"]
