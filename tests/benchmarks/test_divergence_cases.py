"""The divergence benchmark's cases and measurements, without a service: the case files are valid recipes, the
halves differ the way the benchmark promises, and the metric definitions do what the README says."""

from __future__ import annotations

import math
from typing import Any

import pytest

from benchmarks.divergence.cases import POLICIES, load_cases
from benchmarks.divergence.fresh import FAULTS_OFF, SCENARIOS, SETS
from benchmarks.divergence.metrics import (
    evaluate_targets,
    final_loss,
    lineage_curve,
    loss_onset,
    skipped_steps,
    steps_executed,
)
from benchmarks.divergence.run import plan_submissions
from contracts.recipe import RegressionData, validate_recipe_data
from contracts.recipe.imports import named_modules
from workers.data import build_data

CASES = load_cases()


def test_there_are_enough_cases_in_both_halves_with_every_family() -> None:
    assert len(CASES) >= 14
    fams = {half: {c.family for c in CASES if c.half == half} for half in ("dev", "validation")}
    assert fams["dev"] == fams["validation"]
    assert {"high_lr_no_warmup", "warmup_peak_spike", "silent_gradient_corruption", "poisoned_batch",
            "fp16_loss_scale_collapse", "sgd_beyond_stability_limit", "exploding_rnn", "vanishing_gradients",
            "control"} <= fams["dev"]
    for half in ("dev", "validation"):
        controls = [c for c in CASES if c.half == half and c.expected == "control"]
        assert len({c.recipe["training"]["seed"] for c in controls}) >= 3
        high_lr = [c for c in CASES if c.half == half and c.family == "high_lr_no_warmup"]
        assert len({c.recipe["training"]["seed"] for c in high_lr}) >= 3
        assert len({c.recipe["model"]["d_model"] for c in high_lr}) >= 2


def test_the_halves_share_no_seed_and_no_recipe() -> None:
    seeds = {h: {c.recipe["training"]["seed"] for c in CASES if c.half == h} for h in ("dev", "validation")}
    assert not seeds["dev"] & seeds["validation"]
    for fam in {c.family for c in CASES}:
        dev = [c.recipe for c in CASES if c.half == "dev" and c.family == fam]
        val = [c.recipe for c in CASES if c.half == "validation" and c.family == fam]
        for v in val:
            assert all({k: x for k, x in v.items() if k != "name"} != {k: x for k, x in d.items() if k != "name"}
                       for d in dev)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_every_policy_and_reference_is_a_valid_recipe_that_differs_only_in_recovery(case: Any) -> None:
    docs = {p: case.policy_recipe(p) for p in POLICIES}
    for doc in [*docs.values(), case.reference_recipe()]:
        validate_recipe_data(doc)
    strip = [{k: v for k, v in d.items() if k not in ("name", "recovery")} for d in docs.values()]
    assert all(s == strip[0] for s in strip)
    assert docs["none"]["recovery"] == {"max_retries": 0}
    assert docs["restart-latest"]["recovery"] == {"strategy": "restart_latest"}
    assert docs["ballast"]["recovery"] == {}
    if case.expected == "control":
        assert case.reference == case.recipe
    else:
        assert case.reference != case.recipe


def test_least_squares_cases_sit_beyond_and_their_references_below_2_over_lambda_max() -> None:
    for case in CASES:
        if case.family != "sgd_beyond_stability_limit" and case.recipe["model"]["name"] != "linear":
            continue
        d = {k: v for k, v in case.recipe["data"].items() if k != "name"}
        data = build_data(RegressionData(**d), seed=0, batch_size=case.recipe["training"]["batch_size"])
        assert case.recipe["training"]["batch_size"] == d["num_samples"]  # full batch: the Hessian is exact
        assert case.recipe["optimizer"]["momentum"] == 0.0
        k = case.recipe["optimizer"]["lr"] * data.hessian_lambda_max / 2  # type: ignore[attr-defined]
        k_ref = case.reference["optimizer"]["lr"] * data.hessian_lambda_max / 2  # type: ignore[attr-defined]
        if case.expected == "control":
            assert k < 1
        else:
            assert 1.05 <= k <= 1.2 and k_ref < 1, case.name


def test_identical_trainings_are_submitted_once() -> None:
    subs, roles = plan_submissions(CASES)
    assert len(subs) < 4 * len(CASES)
    for case in CASES:
        if case.expected == "control":
            assert roles[(case.name, "reference")] == roles[(case.name, "none")]


# --------------------------------------------------------------------------------------------- metrics
def _data(points: list[tuple[int, int, float | None]], attempts: int = 1) -> dict[str, Any]:
    """(attempt, step, loss or None for a non-finite loss) → the shape the runner collects from REST."""
    ran = [(a, s) for a, s, _ in points]
    fin = [(a, s, v) for a, s, v in points if v is not None]
    return {
        "series": {
            "lr": {"attempts": [a for a, _ in ran], "steps": [s for _, s in ran], "values": [0.1] * len(ran)},
            "loss": {"attempts": [a for a, _, _ in fin], "steps": [s for _, s, _ in fin],
                     "values": [v for _, _, v in fin]},
        },
        "run": {}, "attempts": [{} for _ in range(attempts)], "anomalies": [],
    }


def test_lineage_takes_the_newest_attempt_per_step_and_final_loss_its_last_20_steps() -> None:
    first = [(1, s, 1.0) for s in range(30)]            # attempt 1 ran 0..29
    retry = [(2, s, 2.0) for s in range(10, 40)]         # rolled back to 10, ran 10..39
    data = _data(first + retry, attempts=2)
    curve = lineage_curve(data)
    assert [curve[s] for s in (0, 9, 10, 39)] == [1.0, 1.0, 2.0, 2.0]
    assert final_loss(data, 40) == (2.0, True)
    assert steps_executed(data) == 60
    data["attempts"][1] = {"plan": {"lr_probe": {"candidates": [0.1, 0.025], "steps": 10, "steps_run": 16}}}
    assert steps_executed(data) == 76  # a retry's LR probe ran 16 more


def test_a_non_finite_step_in_the_window_makes_the_final_loss_infinite() -> None:
    pts = [(1, s, 1.0) for s in range(40)]
    pts[35] = (1, 35, None)
    assert final_loss(_data(pts), 40) == (math.inf, True)
    assert final_loss(_data(pts[:30]), 40)[1] is False  # stopped early: last 20 steps it has, flagged


def test_the_final_loss_leaves_out_the_lineage_steps_whose_update_was_skipped() -> None:
    pts = [(1, s, 1.0) for s in range(40)] + [(2, s, 2.0) for s in range(30, 40)]
    pts[25] = (1, 25, 100.0)  # a poisoned batch, its update skipped
    pts[35] = (1, 35, None)   # a NaN step, skipped by attempt 1 but re-run cleanly by attempt 2
    data = _data(pts, attempts=2)
    assert final_loss(data, 40) == (pytest.approx((100.0 + 9 * 1.0 + 10 * 2.0) / 20), True)
    data["series"]["skipped"] = {"attempts": [1, 1], "steps": [25, 35], "values": [1.0, 1.0]}
    assert skipped_steps(data) == {25}  # step 35's newest run (attempt 2) applied its update
    assert final_loss(data, 40) == (pytest.approx((9 * 1.0 + 10 * 2.0) / 19), True)
    data["series"]["skipped"] = {"attempts": [1] * 20, "steps": list(range(20, 40)), "values": [1.0] * 20}
    data["series"]["skipped"]["attempts"][10:] = [2] * 10
    assert skipped_steps(data) == set(range(20, 39))  # the step attempt 2 stopped at keeps its loss: the model's
    assert final_loss(data, 40) == (2.0, True)
    stopped = _data([(1, s, 1.0) for s in range(5)] + [(1, 5, 9.0)])  # a rollback at step 5 ended the run there
    stopped["series"]["skipped"] = {"attempts": [1], "steps": [5], "values": [1.0]}
    assert skipped_steps(stopped) == set() and final_loss(stopped, 40) == (pytest.approx(14.0 / 6), False)


def test_loss_onset_is_the_first_step_above_1_5x_the_running_minimum() -> None:
    losses = [4.0, 3.0, 2.0, 2.5, 2.9, 3.1, 10.0]
    assert loss_onset(_data([(1, s, v) for s, v in enumerate(losses)])) == 5
    assert loss_onset(_data([(1, 0, 4.0), (1, 1, None)])) == 1
    assert loss_onset(_data([(1, s, 4.0 - 0.01 * s) for s in range(50)])) is None


def _row(case: str, expected: str, seed: int, **ballast: Any) -> dict[str, Any]:
    base = {"state": "succeeded", "final_ratio": 1.0, "attempts": 1, "rollbacks": 0, "retries": 0,
            "steps_ratio": 1.0, "reason": "completed"}
    return {"case": case, "expected": expected, "seed": seed,
            "policies": {"none": dict(base), "restart-latest": dict(base), "ballast": {**base, **ballast}}}


def test_targets_pass_and_fail_as_defined() -> None:
    rows = [_row("r", "recoverable", 0, final_ratio=1.04, attempts=2, rollbacks=1, retries=1, steps_ratio=1.2),
            *[_row(f"c{i}", "control", i) for i in range(3)],
            _row("v", "unrecoverable-vanishing", 9, state="failed", reason="vanishing with depth", retries=1,
                 attempts=2)]
    assert all(ok for _, ok, _ in evaluate_targets(rows))
    rows[0]["policies"]["none"]["final_ratio"] = 2.3  # a SUCCEEDED run far above its reference, any policy
    rows[1]["policies"]["ballast"]["rollbacks"] = 1
    rows[0]["policies"]["ballast"]["steps_ratio"] = 1.4
    verdicts = dict((name, ok) for name, ok, _ in evaluate_targets(rows))
    assert [ok for ok in verdicts.values()] == [True, False, False, True, False]


def test_fresh_scenarios_are_valid_recipes_and_their_references_only_lower_the_lr() -> None:
    for name, (doc, ref_lr) in SCENARIOS.items():
        recipe = validate_recipe_data({**doc, "recovery": {}})
        assert ref_lr < recipe.optimizer.lr, name
        assert "recovery" not in doc and not doc["faults"], name  # the policy's defaults; no injected fault


@pytest.mark.parametrize("fresh_set", ["2026-12-05", "2026-12-06", "2026-12-06b", "2026-12-06c", "2026-12-07c",
                                       "2026-12-07d", "2026-12-07e"])
def test_the_later_fresh_sets_change_one_thing_for_their_references(fresh_set: str) -> None:
    """Each reference lowers the LR, or drops the injected fault; a control is its own reference. A scenario on
    your own code names the modules it imports, and only those are admitted."""
    for name, (doc, ref_lr) in SETS[fresh_set].items():
        recipe = validate_recipe_data({**doc, "recovery": {}}, allowed_import_modules=named_modules(doc))
        assert "recovery" not in doc, name  # the policy's defaults
        if ref_lr == FAULTS_OFF:
            assert doc["faults"], name
        elif name.startswith("control-"):
            assert ref_lr == recipe.optimizer.lr and not doc["faults"], name
        else:
            assert ref_lr < recipe.optimizer.lr and not doc["faults"], name
