"""`ballast train` recovers locally the way the service does: the same pure policy (``decide``) over the attempts
of this process, until an attempt succeeds or the policy gives up; the JSON summary names every attempt."""

from __future__ import annotations

import json
import math
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import api.cli  # noqa: F401  (registers the commands)
from api.cli.app import app
from tests.recipes import EXPLODING_RNN, SLOW_LSTM, recipe_doc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]  # whole (small) training runs in this process

FAULT_STEP = 30
SPIKY: dict[str, Any] = {
    "apiVersion": "ballast/v1", "kind": "StabilityRecipe", "name": "spiky",
    "model": {"name": "tiny_gpt", "n_layers": 1, "d_model": 32},
    "data": {"name": "markov"},
    "training": {"max_steps": 60, "batch_size": 8, "seed": 0},
    "optimizer": {"name": "sgd", "lr": 0.1, "momentum": 0.9},
    "schedule": {"warmup_steps": 5, "decay": "cosine"},
    "clipping": {"method": "none"},
    "detectors": {"grad_norm_spike": {"action": "record"}},
    "checkpoint": {"every_steps": 10},
    "recovery": {"rewarm_steps": 5},
    # every gradient ×1e4 at step 30 of attempt 1 only: unclipped momentum SGD explodes, attempt 2 is spared
    "faults": [{"type": "grad_scale", "step": FAULT_STEP, "factor": 10000.0, "attempt": 1}],
}
spiky = partial(recipe_doc, SPIKY)


def write(tmp_path: Path, doc: dict[str, Any]) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def train(*args: str | Path) -> Any:
    return CliRunner().invoke(app, ["train", *(str(a) for a in args)])


def test_a_divergence_is_retried_from_a_healthy_checkpoint_with_tightened_settings(tmp_path: Path) -> None:
    res = train(write(tmp_path, spiky()), "--checkpoint-dir", tmp_path / "ckpt", "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    assert out["outcome"] == "succeeded" and out["exit_code"] == 0 and out["gave_up"] is None
    first, second = out["attempts"][0], out["attempts"][1]
    assert len(out["attempts"]) >= 2

    assert first["kind"] == "initial" and first["outcome"] == "diverged"
    assert FAULT_STEP <= first["onset_step"] <= FAULT_STEP + 5
    assert first["decision"] and "resumed from step" in first["decision"]
    healthy_before = [c["step"] for c in first["checkpoints"] if c["healthy"] and c["step"] <= first["onset_step"]]

    assert second["kind"] == "numeric_retry" and second["outcome"] == "succeeded"
    parent = second["resumed_from"]
    assert parent["attempt"] == 1 and parent["healthy"] and parent["step"] in healthy_before
    assert parent["step"] <= first["onset_step"] and second["start_step"] == parent["step"]
    assert Path(parent["uri"]).parent == tmp_path / "ckpt" / "attempt-1"
    # tightened: a cumulative diff against the recipe, and the plan's re-warm
    assert second["overrides"], second
    for path, (old, new) in second["overrides"].items():
        assert old != new, path
    if "optimizer.lr" in second["overrides"]:
        assert second["overrides"]["optimizer.lr"][1] < 0.1
    assert second["rewarm_steps"] == 5 and second["reason"] == first["decision"]

    # the top level is the last attempt: it ran from the checkpoint's step to the end, once per step
    assert out["final_step"] == 60 and out["start_step"] == parent["step"]
    assert len(out["losses"]) == 60 - parent["step"]
    assert all(c["path"].startswith(str(tmp_path / "ckpt" / "attempt-2")) for c in out["checkpoints"])


def test_the_text_output_says_what_each_attempt_did(tmp_path: Path) -> None:
    res = train(write(tmp_path, spiky()))
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert any(ln.startswith("attempt 1 diverged at step ") for ln in lines), res.stdout
    started = next(ln for ln in lines if ln.startswith("attempt 2 (numeric_retry) from the step-"))
    assert "checkpoint of attempt 1 with " in started and "→" in started and "re-warm 5 steps" in started
    assert any(ln.startswith("  → attempt 1 diverged") for ln in lines)
    assert any(ln.startswith("succeeded after 60 steps, 2 attempts") for ln in lines), res.stdout


def test_when_the_policy_gives_up_the_exit_code_is_1(tmp_path: Path) -> None:
    res = train(write(tmp_path, spiky(recovery={"max_retries": 0})), "--json")
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert out["outcome"] == "diverged" and out["exit_code"] == 1
    assert [a["outcome"] for a in out["attempts"]] == ["diverged"]
    assert "numeric retry budget exhausted (0/0)" in out["gave_up"]
    assert out["attempts"][0]["decision"] == out["gave_up"]

    text = train(write(tmp_path, spiky(recovery={"max_retries": 0})))
    assert text.exit_code == 1 and "gave up: " in text.stdout


def test_a_crash_restarts_from_the_newest_checkpoint_that_verifies(tmp_path: Path) -> None:
    doc = spiky(optimizer={"name": "adamw", "lr": 0.003}, training={"max_steps": 40},
                faults=[{"type": "corrupt_checkpoint", "step": 20, "attempt": 1}])
    res = train(write(tmp_path, doc), "--checkpoint-dir", tmp_path / "ckpt", "--json")
    assert res.exit_code == 0, res.output
    first, second = json.loads(res.stdout)["attempts"]
    assert first["outcome"] == "crashed" and "corrupted checkpoint" in first["error"]
    # the step-20 checkpoint was damaged: the policy's first choice fails verification, so step 10 it is
    assert [c["step"] for c in first["checkpoints"] if not c["valid"]] == [20]
    assert second["kind"] == "crash_restart" and second["resumed_from"]["step"] == 10
    assert second["overrides"] == {} and second["outcome"] == "succeeded"


def test_a_probed_lr_is_the_attempts_and_the_next_retry_tightens_from_it(tmp_path: Path) -> None:
    """`ballast train` records an LR probe as the service does: the retry's LR override is the LR the probe chose,
    and when that attempt diverges too (a NaN loss injected into it), the next retry cuts from the chosen LR."""
    doc = recipe_doc(EXPLODING_RNN, name="probed", schedule={"warmup_steps": 0, "decay": "constant"},
                     recovery={"rewarm_steps": 0, "lr_probe": {"mode": "on", "steps": 6}},
                     faults=[{"type": "nan_loss", "step": 25, "attempt": 2}])
    res = train(write(tmp_path, doc), "--json")
    assert res.exit_code == 0, res.output
    _, second, third = json.loads(res.stdout)["attempts"]
    probe = second["lr_probe"]
    assert probe["candidates"] == [0.25, 0.0625, 0.015625] and probe["candidates_run"][0]["failed"]
    assert second["overrides"]["optimizer.lr"] == [1.0, probe["chosen"]]
    assert second["reason"].count("lr probe from step 0") == 1  # the event and the end carry it: recorded once
    assert second["outcome"] == "diverged" and second["onset_step"] == 25
    cut = probe["chosen"] * 0.5  # a NaN loss 25 steps in: the LR is halved, from the LR the probe chose
    assert third["lr_probe"]["candidates"][0] == pytest.approx(cut) and third["start_step"] == 20
    assert third["overrides"]["optimizer.lr"] == [1.0, third["lr_probe"]["chosen"]]


def test_a_retry_past_the_step_budget_is_not_started_and_the_probes_steps_count(tmp_path: Path) -> None:
    """The probed run above, held to 1.6x its 40 steps: the third attempt (from step 20, with a probe) could take it
    past 64 steps, so the run gives up, and what it says was spent includes the second attempt's probe."""
    doc = recipe_doc(EXPLODING_RNN, name="budgeted", schedule={"warmup_steps": 0, "decay": "constant"},
                     recovery={"rewarm_steps": 0, "step_budget": 1.6, "lr_probe": {"mode": "on", "steps": 6}},
                     faults=[{"type": "nan_loss", "step": 25, "attempt": 2}])
    res = train(write(tmp_path, doc), "--json")
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    first, second = out["attempts"]
    assert second["outcome"] == "diverged" and second["lr_probe"]["steps_run"] > 0
    spent = first["final_step"] + second["lr_probe"]["steps_run"] + (second["final_step"] - second["start_step"])
    assert f"step budget exhausted: the attempts so far executed {spent} steps" in out["gave_up"]
    assert "budget of 64 (1.6x max_steps 40; recovery.step_budget)" in out["gave_up"]


def test_a_run_that_never_learned_at_too_low_an_lr_is_retried_at_a_higher_one(tmp_path: Path) -> None:
    """The retry after ``never_learned`` probes an LR above the attempt's as well as the cuts and, while the highest
    LR tried is the best, climbs on (``extend``): a too-low LR is raised in one retry, not cut further."""
    res = train(write(tmp_path, SLOW_LSTM), "--json")
    assert res.exit_code == 0, res.output
    out = json.loads(res.stdout)
    first, second = out["attempts"]
    assert first["outcome"] == "diverged" and first["detector"] == "never_learned"
    lr = SLOW_LSTM["optimizer"]["lr"]
    probe = second["lr_probe"]
    assert probe["candidates"][0] == pytest.approx(4 * lr)  # lr / spacing (0.25), then the cuts
    assert all(c < lr for c in probe["candidates"][1:])
    assert probe["extend"] == pytest.approx([16 * lr, 64 * lr, 256 * lr, 1024 * lr, 4096 * lr])
    ran = probe["candidates_run"]

    def score(c: dict[str, Any]) -> float:
        return math.inf if c["score"] is None else float(c["score"])  # None: it failed

    # the candidates descended only while each was the best so far, and each extension ran only because the
    # highest LR before it had the lowest score
    top = max(probe["candidates"])
    extended = [n for n, c in enumerate(ran) if c["lr"] > top]
    assert extended and extended == list(range(extended[0], len(ran)))
    for n in range(1, extended[0] - 1):
        assert score(ran[n]) <= min(score(c) for c in ran[:n])
    for n in extended:
        before = ran[:n]
        assert min(before, key=score) is max(before, key=lambda c: c["lr"])
    assert probe["steps_run"] == sum(c["steps"] for c in ran)
    assert probe["chosen"] == min(ran, key=score)["lr"] > 4 * lr
    assert second["overrides"]["optimizer.lr"] == [lr, probe["chosen"]]
    assert "above the attempt's LR" in first["decision"]
    assert second["outcome"] == "succeeded" and out["outcome"] == "succeeded"
