"""The shipped recipes do what their headers say, and `ballast train` reports it with the right exit code.

- every recipe validates and explains itself in a comment header;
- baseline: 300 steps, zero anomalies on 3 seeds (the false-positive check);
- each unstable-<failure> recipe diverges in attempt 1 and succeeds once the real recovery policy
  (``orchestrator.policy.recovery.decide``) has planned the retry;
- crash recipes: SIGKILL kills the worker (here: the CLI process), a corrupted checkpoint is refused on resume.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import api.cli  # noqa: F401  (registers the commands on app)
from api.cli.app import app
from contracts.overrides import apply_overrides
from contracts.recipe import Recipe, load_recipe
from contracts.wire import AttemptOutcome, AttemptSpec
from orchestrator.policy.recovery import AttemptRecord, CheckpointRecord, GiveUp, decide, effective_recipe
from workers.entry import run_attempt

RECIPES = Path(__file__).resolve().parents[2] / "recipes"
UNSTABLE = sorted(p.name for p in RECIPES.glob("unstable-*.yaml"))

pytestmark = pytest.mark.slow  # whole training runs of the example recipes (minutes in all)


def _load(name: str) -> Recipe:
    return load_recipe((RECIPES / name).read_text())


def test_recipes_validate_and_explain_themselves() -> None:
    names = sorted(p.name for p in RECIPES.glob("*.yaml"))
    assert "baseline.yaml" in names and len(UNSTABLE) >= 4
    for name in names:
        text = (RECIPES / name).read_text()
        recipe = load_recipe(text)
        assert recipe.name == name.removesuffix(".yaml")
        header = text.split("apiVersion", 1)[0]
        assert header.startswith("#") and "What Ballast should do" in header, name
        assert recipe.training.max_steps <= 300, name


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_baseline_has_no_false_positives(seed: int, tmp_path: Path) -> None:
    recipe = apply_overrides(_load("baseline.yaml"), {"training.seed": [0, seed]})
    res = run_attempt(AttemptSpec(recipe=recipe, checkpoint_dir=str(tmp_path)))
    assert res.findings == [] and res.skipped_steps == []
    assert res.outcome == "succeeded" and res.final_step == 300
    assert all(c.healthy for c in res.checkpoints)
    assert res.losses[-1] < 0.5 * res.losses[0]  # it learns: from ln 64 ≈ 4.2 towards the floor ≈ ln 4


def run_with_recovery(recipe: Recipe, root: Path, max_attempts: int = 4) -> list[AttemptOutcome]:
    """Attempts as the orchestrator would run them: attempt → decide() → next attempt, until one does not
    diverge (the policy and the engine meet through AttemptSpec and the checkpoint URIs only)."""
    history: list[AttemptRecord] = []
    checkpoints: list[CheckpointRecord] = []
    results: list[AttemptOutcome] = []
    overrides: dict[str, Any] = {}
    kind, plan_resume, rewarm, offset = "initial", None, 0, 0
    parent: int | None = None
    for number in range(1, max_attempts + 1):
        spec = AttemptSpec(recipe=effective_recipe(recipe, overrides), checkpoint_dir=str(root / f"a{number}"),
                           attempt=number, resume_from=plan_resume, rewarm_steps=rewarm, data_offset=offset)
        res = run_attempt(spec)
        results.append(res)
        for c in res.checkpoints:
            checkpoints.append(CheckpointRecord(id=len(checkpoints) + 1, attempt_number=number, step=c.step,
                                                uri=c.path, healthy=c.healthy))
        history.append(AttemptRecord(
            number=number, kind=kind, outcome=res.outcome, start_step=res.start_step, onset_step=res.onset_step,
            final_step=res.final_step, detector=res.detector, value=res.value, overrides=overrides,
            data_offset=offset, loss_scale_collapsed=res.loss_scale_collapsed,
            median_grad_norm=res.median_grad_norm, resumed_from_id=parent,
        ))
        if res.outcome != "diverged":
            break
        plan = decide(recipe, history, checkpoints)
        assert not isinstance(plan, GiveUp), plan.reason
        kind, overrides, rewarm, offset = plan.kind, plan.overrides_json(), plan.rewarm_steps, plan.data_offset
        plan_resume = plan.resume_from.uri if plan.resume_from is not None else None
        parent = plan.parent_checkpoint_id
    return results


EXPECTED: dict[str, dict[str, Any]] = {
    # recipe: attempt 1's deciding detector, its onset (None: early, any), attempt 2's start step
    "unstable-high-lr.yaml": {"detectors": {"loss_spike", "divergence"}, "onset_before": 10, "resume": 0},
    "unstable-grad-spike.yaml": {"detectors": {"loss_spike", "divergence", "nonfinite"}, "onset_before": 66,
                                 "resume": 50, "recorded": (60, "grad_norm_spike")},
    "unstable-fp16.yaml": {"detectors": {"loss_scale_collapse"}, "onset_before": 21, "resume": 0},
    "unstable-nan.yaml": {"detectors": {"nonfinite"}, "onset_before": 81, "resume": 75, "recorded": (80, "nonfinite")},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_unstable_recipe_diverges_then_the_retry_succeeds(name: str, tmp_path: Path) -> None:
    expected = EXPECTED[name]
    recipe = _load(name)
    results = run_with_recovery(recipe, tmp_path)
    first, last = results[0], results[-1]
    assert first.outcome == "diverged" and first.detector in expected["detectors"]
    assert first.onset_step is not None and first.onset_step < expected["onset_before"]
    if "recorded" in expected:  # the injected fault is caught at its own step, from the numbers
        assert expected["recorded"] in [(f["step"], f["kind"]) for f in first.findings]
    assert len(results) == 2, [r.reason for r in results]
    assert last.outcome == "succeeded" and last.start_step == expected["resume"]
    assert last.findings == []


# ------------------------------------------------------------------------------------------- the CLI
runner = CliRunner()


def test_train_cli_success_and_bad_recipe(tmp_path: Path) -> None:
    ok = runner.invoke(app, ["train", str(RECIPES / "baseline.yaml"), "--steps", "40", "--json"])
    assert ok.exit_code == 0, ok.output
    bad = tmp_path / "bad.yaml"
    bad.write_text("apiVersion: ballast/v1\nkind: StabilityRecipe\nname: bad\noptimizer:\n  lr: -1\n")
    res = runner.invoke(app, ["train", str(bad)])
    assert res.exit_code == 2
    assert "optimizer.lr" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, ["train", str(RECIPES / "unstable-nan.yaml"), "--steps", "50"])
    assert res.exit_code == 2 and "faults.0.step" in res.output  # the fault at step 80 is beyond 50 steps


def test_train_cli_divergence_is_recovered_locally(tmp_path: Path) -> None:
    res = runner.invoke(app, ["train", str(RECIPES / "unstable-nan.yaml"), "--steps", "90", "--checkpoint-dir",
                              str(tmp_path)])
    assert res.exit_code == 0, res.output  # the policy's retry from step 75 runs in the same command
    assert "attempt 1 diverged at step 80 (nonfinite)" in res.stdout
    assert "attempt 2 (numeric_retry) from the step-75 checkpoint of attempt 1" in res.stdout


def test_worker_crash_recipe_sigkills_the_worker_after_its_checkpoints(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", "from api.cli import main; main()", "train",
         str(RECIPES / "unstable-worker-crash.yaml"), "--checkpoint-dir", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (tmp_path / "attempt-1").iterdir()) == ["step_00000025", "step_00000050"]


def test_corrupt_checkpoint_recipe_is_refused_on_resume(tmp_path: Path) -> None:
    crashed = runner.invoke(app, ["train", str(RECIPES / "unstable-corrupt-checkpoint.yaml"), "--checkpoint-dir",
                                  str(tmp_path)])
    # attempt 1 crashes; the crash restart skips the damaged step-50 checkpoint and resumes from step 25
    assert crashed.exit_code == 0 and "corrupted checkpoint" in crashed.output, crashed.output
    assert "attempt 2 (crash_restart) from the step-25 checkpoint of attempt 1" in crashed.stdout
    res = runner.invoke(app, ["train", str(RECIPES / "unstable-corrupt-checkpoint.yaml"), "--resume",
                              str(tmp_path / "attempt-1" / "step_00000050")])
    assert res.exit_code == 2
    assert "corrupt checkpoint" in res.output and "sha256 mismatch" in res.output
