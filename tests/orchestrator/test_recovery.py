"""Table tests of the pure recovery policy: one test (or table row) per branch of ``decide``."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from contracts.overrides import apply_overrides
from contracts.recipe import Recipe
from orchestrator.policy.recovery import (
    AttemptRecord,
    CheckpointRecord,
    GiveUp,
    RecoveryPlan,
    decide,
    effective_values,
    manual_retry_checkpoint,
    normalize_overrides,
)
from orchestrator.policy.tightening import MIN_AGC_LAMBDA
from tests.recipes import build_recipe

recipe = partial(build_recipe, {"name": "t", "training": {"max_steps": 2000}})


def cps(attempt: int, steps: range | list[int], *, start_id: int = 1, **kw: Any) -> list[CheckpointRecord]:
    return [CheckpointRecord(start_id + i, attempt, s, f"file:///ck/{attempt}/{s}", kw.get("healthy", True))
            for i, s in enumerate(steps)]


def diverged(number: int = 1, onset: int = 812, *, kind: str = "initial", start: int = 0, **kw: Any) -> AttemptRecord:
    kw.setdefault("detector", "divergence")
    return AttemptRecord(number=number, kind=kind, outcome="diverged", start_step=start, onset_step=onset,
                         final_step=onset + 2, **kw)


def crashed(number: int = 1, *, kind: str = "initial", start: int = 0, **kw: Any) -> AttemptRecord:
    kw.setdefault("error", "worker died")
    return AttemptRecord(number=number, kind=kind, outcome="crashed", start_step=start, **kw)


def plan(r: Recipe, history: list[AttemptRecord], checkpoints: list[CheckpointRecord]) -> RecoveryPlan:
    out = decide(r, history, checkpoints)
    assert isinstance(out, RecoveryPlan), out
    return out


def give_up(r: Recipe, history: list[AttemptRecord], checkpoints: list[CheckpointRecord]) -> GiveUp:
    out = decide(r, history, checkpoints)
    assert isinstance(out, GiveUp), out
    return out


def follow(prev: AttemptRecord, p: RecoveryPlan, number: int, *, outcome: str = "diverged",
           onset: int | None = None, **kw: Any) -> AttemptRecord:
    """The attempt the scheduler would start from plan ``p``, ended with ``outcome``."""
    return AttemptRecord(number=number, kind=p.kind, outcome=outcome, start_step=p.resume_step,
                         onset_step=onset, final_step=onset, overrides=p.overrides_json(),
                         data_offset=p.data_offset, resumed_from_id=p.parent_checkpoint_id,
                         detector=kw.pop("detector", "loss_spike" if outcome == "diverged" else None), **kw)


EVERY_100 = cps(1, range(0, 900, 100))  # ids 1..9 at steps 0..800


# ------------------------------------------------------------------------------------ diverged: where to resume
@pytest.mark.parametrize(
    ("margin", "onset", "expected_step"),
    [
        (0, 812, 800),    # newest healthy checkpoint at or before the onset
        (0, 800, 800),    # a checkpoint at the onset step holds the state before that step's update
        (150, 812, 600),  # at least 150 steps before: <= 662
        (12, 812, 800),   # exactly the margin still qualifies
        (13, 812, 700),
    ],
)
def test_diverged_resumes_from_newest_healthy_checkpoint_before_onset_minus_margin(
    margin: int, onset: int, expected_step: int
) -> None:
    p = plan(recipe(recovery={"rollback_margin_steps": margin}), [diverged(onset=onset)], EVERY_100)
    assert p.kind == "numeric_retry"
    assert p.resume_from is not None and p.resume_from.step == expected_step
    assert p.resume_step == expected_step
    assert p.parent_checkpoint_id == p.resume_from.id
    assert p.plan_json()["resume_uri"] == f"file:///ck/1/{expected_step}"


def test_a_checkpoint_at_max_steps_is_never_the_rollback_target() -> None:
    """An end verdict (``degraded``) can put the onset at the last step; the checkpoint saved there holds the
    finished run, and resuming from it would leave the retry nothing to train."""
    r = recipe(training={"max_steps": 150}, recovery={"rollback_margin_steps": 0})
    ended = AttemptRecord(number=1, kind="initial", outcome="diverged", start_step=0, onset_step=150,
                          final_step=150, detector="degraded")
    p = plan(r, [ended], cps(1, [25, 50, 75, 100, 125, 150]))
    assert p.resume_from is not None and p.resume_step == 125


def test_diverged_skips_unhealthy_and_invalid_checkpoints() -> None:
    checkpoints = [
        CheckpointRecord(1, 1, 600, "u600", healthy=True),
        CheckpointRecord(2, 1, 700, "u700", healthy=True, valid=False),
        CheckpointRecord(3, 1, 800, "u800", healthy=False),
    ]
    p = plan(recipe(), [diverged(onset=812)], checkpoints)
    assert p.resume_from == checkpoints[0]


def test_diverged_without_qualifying_checkpoint_restarts_from_initialisation() -> None:
    checkpoints = cps(1, [100, 200]) + [CheckpointRecord(9, 1, 50, "u50", healthy=False)]
    p = plan(recipe(recovery={"rollback_margin_steps": 50}), [diverged(onset=120)], checkpoints)
    assert p.resume_from is None and p.resume_step == 0
    assert p.plan_json()["resume_uri"] is None
    assert "restarted from initialisation" in p.reason


def test_repeat_failure_soon_after_resuming_goes_further_back() -> None:
    r = recipe()  # early_failure_steps 20
    first = plan(r, [diverged(1, 812)], EVERY_100)
    assert first.resume_step == 800
    # attempt 2 failed 5 steps after resuming at 800: its start point is suspect
    early = follow(diverged(1, 812), first, 2, onset=805)
    p = plan(r, [diverged(1, 812), early], EVERY_100)
    assert p.resume_step == 700
    assert "went further back" in p.reason and "5 steps after resuming at step 800" in p.reason
    # 50 steps after its start is not early: the newest healthy checkpoint of attempt 2's own is used
    late = follow(diverged(1, 812), first, 2, onset=860)
    own = cps(2, [850], start_id=20)
    p = plan(r, [diverged(1, 812), late], EVERY_100 + own)
    assert p.resume_from == own[0]


def test_repeat_failure_with_nothing_older_restarts_from_initialisation() -> None:
    r = recipe()
    checkpoints = cps(1, [100])
    first = plan(r, [diverged(1, 130)], checkpoints)
    assert first.resume_step == 100
    p = plan(r, [diverged(1, 130), follow(diverged(1, 130), first, 2, onset=103)], checkpoints)
    assert p.resume_from is None and p.resume_step == 0


def test_checkpoints_of_an_abandoned_branch_are_never_resumed() -> None:
    """Attempt 1 reached 800 and diverged at 812; attempt 2 resumed at 600 (margin). Its 800 is attempt 1's."""
    r = recipe(recovery={"rollback_margin_steps": 200, "early_failure_steps": 0})
    first = plan(r, [diverged(1, 812)], EVERY_100)
    assert first.resume_step == 600
    second = follow(diverged(1, 812), first, 2, onset=1050)
    own = cps(2, [700, 800], start_id=20)
    p = plan(r, [diverged(1, 812), second], EVERY_100 + own)
    # limit 850: attempt 2's own 800 (not attempt 1's 800, which led to the divergence)
    assert p.resume_from == own[1]
    # and with no own checkpoints, the lineage continues below 600 in attempt 1, never 700/800 of attempt 1
    second = follow(diverged(1, 812), first, 2, onset=850)
    assert plan(r, [diverged(1, 812), second], EVERY_100).resume_step == 600


def test_a_manual_retry_resumes_from_the_newest_valid_healthy_checkpoint_of_the_lineage() -> None:
    r = recipe(recovery={"rollback_margin_steps": 200, "early_failure_steps": 0})
    first = plan(r, [diverged(1, 812)], EVERY_100)
    second = follow(diverged(1, 812), first, 2, onset=1050)
    own = cps(2, [700], start_id=20) + cps(2, [800], start_id=21, healthy=False)
    history = [diverged(1, 812), second]
    assert manual_retry_checkpoint(history, EVERY_100 + own) == own[0]  # never attempt 1's 700 or 800
    corrupt = [CheckpointRecord(20, 2, 700, "file:///ck/2/700", True, valid=False)]
    got = manual_retry_checkpoint(history, EVERY_100 + corrupt)
    assert got is not None and got.step == 600
    assert manual_retry_checkpoint([], EVERY_100) is None
    assert manual_retry_checkpoint([crashed(1)], []) is None


# -------------------------------------------------------------------------------------- diverged: tightening
@pytest.mark.parametrize(
    ("optimizer", "order", "detector", "first", "second"),
    [
        # auto, by evidence: a loss divergence lowers the LR first whatever the optimizer; clip joins on the 2nd
        ("adamw", "auto", "divergence", {"optimizer.lr"}, {"optimizer.lr", "clipping.max_norm"}),
        ("sgd", "auto", "eval_degraded", {"optimizer.lr"}, {"optimizer.lr", "clipping.max_norm"}),
        # ... or already on the 1st when its probe replays a one-step end: the cut LRs train only if the replay
        # shows the divergence recurs, and then the clip joins them (the replay reverts both)
        ("sgd", "auto", "loss_spike", {"optimizer.lr", "clipping.max_norm"}, {"optimizer.lr", "clipping.max_norm"}),
        ("sgd", "auto", "nonfinite", {"optimizer.lr", "clipping.max_norm"}, {"optimizer.lr", "clipping.max_norm"}),
        # auto, by evidence: a gradient spike with a healthy loss tightens the clip first, whatever the optimizer
        ("adamw", "auto", "grad_norm_spike", {"clipping.max_norm"}, {"optimizer.lr", "clipping.max_norm"}),
        ("adam", "auto", "skip_escalation", {"clipping.max_norm"}, {"optimizer.lr", "clipping.max_norm"}),
        # auto with evidence it does not know: the optimizer family (Adam: LR; SGD: clip)
        ("adamw", "auto", "custom_kind", {"optimizer.lr"}, {"optimizer.lr", "clipping.max_norm"}),
        ("sgd", "auto", None, {"clipping.max_norm"}, {"optimizer.lr", "clipping.max_norm"}),
        # explicit orders win over the evidence
        ("sgd", "lr_first", "grad_norm_spike", {"optimizer.lr", "clipping.max_norm"},
         {"optimizer.lr", "clipping.max_norm"}),  # a replayed one-step end, as above
        ("adamw", "clip_first", "divergence", {"clipping.max_norm"}, {"optimizer.lr", "clipping.max_norm"}),
        ("adamw", "both", "grad_norm_spike", {"optimizer.lr", "clipping.max_norm"},
         {"optimizer.lr", "clipping.max_norm"}),
    ],
)
def test_tighten_order(optimizer: str, order: str, detector: str | None, first: set[str], second: set[str]) -> None:
    r = recipe(optimizer={"name": optimizer, "lr": 0.004}, clipping={"max_norm": 2.0},
               recovery={"tighten_order": order})
    p1 = plan(r, [diverged(1, 812, detector=detector)], EVERY_100)
    assert set(p1.overrides) == first
    a2 = follow(diverged(1, 812), p1, 2, onset=900)
    p2 = plan(r, [diverged(1, 812), a2], EVERY_100)
    assert set(p2.overrides) == second
    # cumulative against the ORIGINAL recipe
    expected = {"optimizer.lr": 0.004, "clipping.max_norm": 2.0}
    for path in second:
        times = (path in first) + (path in second)
        assert p2.overrides[path] == (expected[path], expected[path] * 0.5**times)


def test_reason_names_the_onset_detector_checkpoint_and_every_change() -> None:
    r = recipe(optimizer={"lr": 3e-3}, recovery={"tighten_order": "both", "rewarm_steps": 50,
                                                  "skip_data_window": True, "rollback_margin_steps": 200})
    checkpoints = cps(2, range(0, 900, 200))  # 0, 200, 400, 600, 800
    p = plan(r, [diverged(2, 812, detector="grad_norm_spike", value=9.3)], checkpoints)
    assert p.reason == (
        "attempt 2 diverged (onset at step 812, grad_norm_spike=9.3); resumed from step 600; "
        "lr 0.003→0.0015, clip 1.0→0.5, re-warm 50 steps, lr probe of 0.0015, 0.000375, 9.375e-05 for 100 steps "
        "each (the re-warm goes if the chosen LR trains cleanly), skipped data 600–812"
    )
    assert p.rewarm_steps == 50


def test_lr_floor_and_clip_floor() -> None:
    r = recipe(optimizer={"lr": 1.5e-6}, clipping={"max_norm": 0.015},
               recovery={"tighten_order": "both", "min_lr": 1e-6, "min_clip": 0.01})
    p = plan(r, [diverged()], EVERY_100)
    assert p.overrides == {"optimizer.lr": (1.5e-6, 1e-6), "clipping.max_norm": (0.015, 0.01)}


def test_primary_knob_at_floor_tightens_the_secondary_on_the_first_retry() -> None:
    r = recipe(optimizer={"name": "adamw", "lr": 1e-6}, recovery={"min_lr": 1e-6})
    p = plan(r, [diverged()], EVERY_100)
    assert p.overrides == {"clipping.max_norm": (1.0, 0.5)}


def test_lr_below_the_floor_is_never_raised() -> None:
    r = recipe(optimizer={"lr": 1e-7}, recovery={"min_lr": 1e-6, "tighten_order": "lr_first"})
    p = plan(r, [diverged()], EVERY_100)
    assert "optimizer.lr" not in p.overrides
    assert p.overrides == {"clipping.max_norm": (1.0, 0.5)}


def test_everything_at_its_floor_gives_up_with_the_floors_in_the_reason() -> None:
    r = recipe(optimizer={"lr": 1e-6}, clipping={"max_norm": 0.01}, recovery={"min_lr": 1e-6, "min_clip": 0.01})
    out = give_up(r, [diverged(4, 812, detector="loss_spike")], EVERY_100)
    assert out.reason == (
        "attempt 4 diverged (onset at step 812, loss_spike); "
        "nothing left to tighten (lr at floor 1e-06, clip at floor 0.01)"
    )


def test_floors_reached_through_overrides_give_up() -> None:
    r = recipe(optimizer={"lr": 4e-6}, clipping={"max_norm": 0.04}, recovery={"max_retries": 10})
    last = diverged(3, 300, kind="numeric_retry", start=200,
                    overrides={"optimizer.lr": [4e-6, 1e-6], "clipping.max_norm": [0.04, 0.01]})
    assert isinstance(decide(r, [diverged(1, 812), last], EVERY_100), GiveUp)


@pytest.mark.parametrize(
    ("multiple", "median", "expected_clip"),
    [
        (2.0, 0.1, 0.2),       # 2 × median, lower than 1.0
        (2.0, 0.001, 0.01),    # ... floored at min_clip
        (2.0, 3.0, 0.5),       # 6.0 would raise the clip: clip_factor instead
        (2.0, None, 0.5),      # median unknown: clip_factor
        (None, 0.1, 0.5),      # median option off
    ],
)
def test_median_based_clip(multiple: float | None, median: float | None, expected_clip: float) -> None:
    r = recipe(recovery={"tighten_order": "clip_first", "clip_to_median_multiple": multiple})
    p = plan(r, [diverged(median_grad_norm=median)], EVERY_100)
    assert p.overrides["clipping.max_norm"] == (1.0, pytest.approx(expected_clip))


def test_median_from_an_earlier_attempt_is_used_when_the_last_measured_none() -> None:
    r = recipe(recovery={"tighten_order": "clip_first", "clip_to_median_multiple": 2.0})
    first = diverged(1, 812, median_grad_norm=0.1)
    p1 = plan(r, [first], EVERY_100)
    second = follow(first, p1, 2, onset=900, median_grad_norm=None)
    p2 = plan(r, [first, second], EVERY_100)
    # 0.2 already; the median target (0.2) does not lower it, so clip_factor halves it
    assert p1.overrides["clipping.max_norm"] == (1.0, pytest.approx(0.2))
    assert p2.overrides["clipping.max_norm"] == (1.0, pytest.approx(0.1))
    assert "2.0×median grad norm 0.1" in p1.reason


@pytest.mark.parametrize(
    ("multiple", "median", "max_norm", "expected"),
    [
        (None, None, 1.0, {"clipping.method": ("none", "global_norm")}),
        (None, None, 3.0, {"clipping.method": ("none", "global_norm")}),
        (2.0, 0.25, 1.0, {"clipping.method": ("none", "global_norm"), "clipping.max_norm": (1.0, 0.5)}),
    ],
)
def test_clipping_none_turns_on_global_norm(
    multiple: float | None, median: float | None, max_norm: float, expected: dict[str, Any]
) -> None:
    r = recipe(optimizer={"name": "sgd"}, clipping={"method": "none", "max_norm": max_norm},
               recovery={"clip_to_median_multiple": multiple})
    p = plan(r, [diverged(median_grad_norm=median, detector="grad_norm_spike")], EVERY_100)
    assert p.overrides == expected
    assert "clipping none→global_norm" in p.reason
    eff = apply_overrides(r, p.overrides_json())
    assert eff.clipping.method.value == "global_norm"


def test_adaptive_clipping_tightens_agc_lambda_down_to_its_floor() -> None:
    r = recipe(optimizer={"name": "sgd"}, clipping={"method": "adaptive", "agc_lambda": 0.04})
    p = plan(r, [diverged(detector="grad_norm_spike")], EVERY_100)
    assert p.overrides == {"clipping.agc_lambda": (0.04, 0.02)}
    at_floor = recipe(optimizer={"name": "sgd", "lr": 1e-6}, clipping={"method": "adaptive",
                                                                       "agc_lambda": MIN_AGC_LAMBDA})
    assert "agc_lambda at floor" in give_up(at_floor, [diverged(detector="grad_norm_spike")], EVERY_100).reason


def test_per_layer_clipping_ignores_the_global_median() -> None:
    r = recipe(clipping={"method": "per_layer"},
               recovery={"tighten_order": "clip_first", "clip_to_median_multiple": 2.0})
    p = plan(r, [diverged(median_grad_norm=0.1)], EVERY_100)
    assert p.overrides == {"clipping.max_norm": (1.0, 0.5)}


# ------------------------------------------------------------------------------------ diverged: data, dtype
def test_skip_data_window_accumulates_over_retries() -> None:
    r = recipe(recovery={"skip_data_window": True, "early_failure_steps": 0})
    first = diverged(1, 812)
    p1 = plan(r, [first], EVERY_100)
    assert (p1.resume_step, p1.data_offset) == (800, 13)  # batches of steps 800..812 skipped
    second = follow(first, p1, 2, onset=930)
    own = cps(2, [850, 900], start_id=20)
    p2 = plan(r, [first, second], EVERY_100 + own)
    assert (p2.resume_step, p2.data_offset) == (900, 13 + 31)
    assert "skipped data 900–930" in p2.reason


def test_without_skip_data_window_the_offset_is_carried_over() -> None:
    p = plan(recipe(), [diverged(1, 812, data_offset=7)], EVERY_100)
    assert p.data_offset == 7
    assert "skipped data" not in p.reason


@pytest.mark.parametrize(
    ("dtype", "collapsed", "switch", "expect_bf16"),
    [
        ("fp16", True, True, True),
        ("fp16", False, True, False),
        ("fp16", True, False, False),
        ("bf16", True, True, False),
    ],
)
def test_fp16_to_bf16_when_the_loss_scale_collapsed(dtype: str, collapsed: bool, switch: bool,
                                                     expect_bf16: bool) -> None:
    r = recipe(precision={"dtype": dtype}, recovery={"fp16_to_bf16": switch})
    p = plan(r, [diverged(loss_scale_collapsed=collapsed)], EVERY_100)
    assert (p.overrides.get("precision.dtype") == ("fp16", "bf16")) is expect_bf16
    assert ("fp16→bf16" in p.reason) is expect_bf16
    # an fp16 overflow changes the dtype only (the step size is not to blame); anything else tightens the LR
    assert ("optimizer.lr" in p.overrides) is not expect_bf16


@pytest.mark.parametrize(
    ("dtype", "detector", "expect"),
    [
        ("fp16", "nonfinite", {"precision.dtype": ("fp16", "bf16")}),
        # the LR, and the clip for the cut candidates should the probe's replay show it recurs
        ("bf16", "nonfinite", {"optimizer.lr": (1e-3, 5e-4), "clipping.max_norm": (1.0, 0.5)}),
        ("fp16", "loss_spike", {"optimizer.lr": (1e-3, 5e-4), "clipping.max_norm": (1.0, 0.5)}),
    ],
)
def test_non_finite_values_in_fp16_switch_the_dtype_alone(dtype: str, detector: str,
                                                          expect: dict[str, tuple[object, object]]) -> None:
    r = recipe(precision={"dtype": dtype})
    p = plan(r, [diverged(detector=detector)], EVERY_100)
    assert p.overrides == expect
    assert ("non-finite values in fp16" in p.reason) is (expect.get("precision.dtype") is not None)


@pytest.mark.parametrize(
    ("dtype", "collapsed", "rewarm"),
    [
        ("fp16", True, 0),  # the dtype alone changes: the LR and its schedule stay the recipe's
        ("bf16", True, 20),  # an LR cut is eased in
        ("fp16", False, 20),
    ],
)
def test_a_dtype_switch_alone_has_no_rewarm(dtype: str, collapsed: bool, rewarm: int) -> None:
    r = recipe(precision={"dtype": dtype}, recovery={"rewarm_steps": 20})
    p = plan(r, [diverged(loss_scale_collapsed=collapsed)], EVERY_100)
    assert p.rewarm_steps == rewarm
    assert ("re-warm" in p.reason) is (rewarm > 0)


def test_after_the_switch_to_bf16_a_recurrence_tightens_the_lr() -> None:
    r = recipe(precision={"dtype": "fp16"})
    first = diverged(1, 812, loss_scale_collapsed=True)
    p1 = plan(r, [first], EVERY_100)
    second = diverged(2, 830, kind="numeric_retry", start=800, detector="nonfinite",
                      overrides=p1.overrides_json())
    p2 = plan(r, [first, second], EVERY_100)
    assert p2.overrides["precision.dtype"] == ("fp16", "bf16")
    assert p2.overrides["optimizer.lr"][1] < 1e-3


def test_dtype_switch_alone_is_enough_when_lr_and_clip_are_at_floor() -> None:
    r = recipe(optimizer={"lr": 1e-6}, clipping={"max_norm": 0.01}, precision={"dtype": "fp16"})
    p = plan(r, [diverged(loss_scale_collapsed=True)], EVERY_100)
    assert p.overrides == {"precision.dtype": ("fp16", "bf16")}


# --------------------------------------------------------------------------------------------------- budgets
def test_numeric_budget_exhausted() -> None:
    r = recipe()  # max_retries 3
    history = [diverged(1, 100)] + [diverged(n, 100 + n, kind="numeric_retry", start=100) for n in (2, 3, 4)]
    history[-1] = diverged(4, 120, kind="numeric_retry", start=100, detector="loss_spike")
    assert give_up(r, history, EVERY_100).reason == (
        "attempt 4 diverged (onset at step 120, loss_spike); numeric retry budget exhausted (3/3)"
    )
    # one fewer retry used: still planned
    assert isinstance(decide(r, history[:-1], EVERY_100), RecoveryPlan)


def test_zero_retries_gives_up_on_the_first_divergence() -> None:
    out = give_up(recipe(recovery={"max_retries": 0}), [diverged()], EVERY_100)
    assert "numeric retry budget exhausted (0/0)" in out.reason


def test_a_manual_retry_grants_fresh_budgets() -> None:
    history = [diverged(1, 100), diverged(2, 110, kind="numeric_retry", start=100),
               diverged(3, 120, kind="manual"), ]
    r = recipe(recovery={"max_retries": 1})
    assert isinstance(decide(r, history[:2], EVERY_100), GiveUp)
    assert isinstance(decide(r, history, EVERY_100), RecoveryPlan)


@pytest.mark.parametrize(
    ("budget", "attempt_steps", "probe_steps", "planned"),
    [
        # max_steps 2000; the retry resumes from initialisation (onset 5: no checkpoint before it) and so could
        # need 2000 steps plus its probe (tighten: lr 1e-3 → 2.5e-4 at an early divergence; probe off here)
        (3.0, [5, 2000], 0, True),           # 2005 spent + 2000 = 4005 <= 6000
        (3.0, [5, 2000, 1996], 0, False),     # 4001 + 2000 > 6000
        (3.0, [5, 1996], 2000, False),        # a probe's steps count too: 4001 + 2000 > 6000
        (3.0, [2000, 2000], 0, True),         # exactly at the budget: 4000 + 2000 = 6000
        (None, [5, 2000, 1996, 2000], 0, True),  # no budget: only max_retries bounds it
    ],
)
def test_a_retry_that_could_overrun_the_step_budget_is_not_started(
    budget: float | None, attempt_steps: list[int], probe_steps: int, planned: bool
) -> None:
    r = recipe(recovery={"step_budget": budget, "max_retries": 10, "lr_probe": {"mode": "off"}})
    history = [AttemptRecord(number=n, kind="initial" if n == 1 else "numeric_retry", outcome="diverged",
                             start_step=0, onset_step=5, final_step=steps, detector="divergence",
                             probe_steps=probe_steps if n == 2 else 0)
               for n, steps in enumerate(attempt_steps, start=1)]
    out = decide(r, history, cps(1, [0]))
    assert isinstance(out, RecoveryPlan) is planned, out
    if not planned:
        spent = sum(attempt_steps) + probe_steps
        assert isinstance(out, GiveUp)
        assert out.reason.endswith(
            f"step budget exhausted: the attempts so far executed {spent} steps and the retry from step 0 could "
            "need 2000 more, past the budget of 6000 (3x max_steps 2000; recovery.step_budget)"), out.reason


def test_the_step_budget_charges_the_retry_its_probe_and_counts_from_the_newest_manual_retry() -> None:
    r = recipe(training={"max_steps": 200}, recovery={"max_retries": 10, "step_budget": 2.0})
    history = [AttemptRecord(number=1, kind="initial", outcome="diverged", start_step=0, onset_step=150,
                             final_step=150, detector="divergence")]
    every_25 = cps(1, range(0, 200, 25))
    p = plan(r, history, every_25)  # resumes at 150 with a probe of 3 x 13 steps: 150 + 50 + 39 <= 400
    assert p.resume_step == 150 and p.lr_probe is not None and p.lr_probe.max_steps == 39
    late = [replace(history[0], final_step=312 + 1, onset_step=150)]  # 313 spent: 313 + 50 + 39 > 400
    assert "step budget exhausted" in give_up(r, late, every_25).reason
    assert isinstance(decide(r, [*late, diverged(2, 150, kind="manual", start=0)], every_25), RecoveryPlan)


def test_crash_restarts_are_not_held_to_the_step_budget() -> None:
    r = recipe(recovery={"step_budget": 1.0})
    history = [diverged(1, 1000, start=0), crashed(2, kind="numeric_retry", start=800, final_step=1990)]
    assert plan(r, history, EVERY_100).kind == "crash_restart"


def test_crash_budget_is_separate_from_the_numeric_budget() -> None:
    r = recipe(recovery={"max_retries": 1, "max_crash_restarts": 2})
    history = [diverged(1, 100), diverged(2, 150, kind="numeric_retry", start=100)]
    assert isinstance(decide(r, history, EVERY_100), GiveUp)  # numeric budget spent
    history[-1] = crashed(2, kind="numeric_retry", start=100)
    assert plan(r, history, EVERY_100).kind == "crash_restart"  # ... crashes still restart
    history += [crashed(3, kind="crash_restart", start=100), crashed(4, kind="crash_restart", start=100,
                                                                     error="OOM")]
    assert give_up(r, history, EVERY_100).reason == (
        "attempt 4 crashed (OOM); crash restart budget exhausted (2/2)"
    )
    # crash restarts do not use up numeric retries
    r = recipe(recovery={"max_retries": 1, "max_crash_restarts": 5})
    history = [crashed(1), crashed(2, kind="crash_restart"), diverged(3, 400, kind="crash_restart")]
    assert plan(r, history, EVERY_100).kind == "numeric_retry"


# ---------------------------------------------------------------------------------------------------- crashes
def test_crash_resumes_from_the_newest_valid_checkpoint_with_unchanged_settings() -> None:
    checkpoints = cps(1, [100, 150]) + [CheckpointRecord(3, 1, 200, "u200", healthy=False)]
    last = crashed(1, data_offset=12, overrides={"optimizer.lr": [1e-3, 5e-4]})
    p = plan(recipe(), [last], checkpoints)
    assert p.kind == "crash_restart"
    assert p.resume_from == checkpoints[2]  # newest valid, healthy or not: the crash is not numeric
    assert p.overrides == {"optimizer.lr": (1e-3, 5e-4)}
    assert (p.rewarm_steps, p.data_offset) == (0, 12)
    assert p.reason == "attempt 1 crashed (worker died); resumed from step 200 with unchanged settings"


def test_crash_with_corrupt_newest_checkpoint_uses_the_previous_one() -> None:
    checkpoints = cps(1, [100, 150]) + [CheckpointRecord(3, 1, 200, "u200", healthy=True, valid=False)]
    p = plan(recipe(), [crashed(1)], checkpoints)
    assert p.resume_from == checkpoints[1]
    assert p.reason == ("attempt 1 crashed (worker died); resumed from step 150 with unchanged settings "
                        "(skipped invalid checkpoint at step 200)")


def test_crash_without_valid_checkpoint_restarts_from_initialisation() -> None:
    checkpoints = [CheckpointRecord(1, 1, 100, "u100", healthy=True, valid=False)]
    p = plan(recipe(), [crashed(1)], checkpoints)
    assert p.resume_from is None and p.resume_step == 0
    assert "restarted from initialisation with unchanged settings" in p.reason


def test_crash_of_a_retry_resumes_in_its_own_lineage() -> None:
    """Attempt 2 resumed at 600 and crashed before its first checkpoint: back to 600, not attempt 1's 800."""
    r = recipe(recovery={"rollback_margin_steps": 200})
    first = plan(r, [diverged(1, 812)], EVERY_100)
    assert first.resume_step == 600
    second = follow(diverged(1, 812), first, 2, outcome="crashed", error="worker died")
    p = plan(r, [diverged(1, 812), second], EVERY_100)
    assert p.resume_step == 600
    assert p.overrides == first.overrides
    # and without the parent id, the lineage falls back to the previous attempt up to the start step
    orphan = AttemptRecord(2, "numeric_retry", "crashed", start_step=600, overrides=first.overrides_json())
    assert plan(r, [diverged(1, 812), orphan], EVERY_100).resume_step == 600


def _probed_retry(outcome: str, **kw: Any) -> tuple[Recipe, list[AttemptRecord], RecoveryPlan]:
    """Attempt 2: the numeric retry of attempt 1's divergence at 812 (from step 800, re-warm 20, an LR probe), ended
    with ``outcome``."""
    r = recipe(optimizer={"lr": 3e-3})
    retry = plan(r, [diverged(1, 812)], EVERY_100)
    assert retry.lr_probe is not None and retry.rewarm_steps == 20
    second = follow(diverged(1, 812), retry, 2, outcome=outcome, rewarm_steps=retry.rewarm_steps, **kw)
    return r, [diverged(1, 812), second], retry


def test_a_crash_before_the_retrys_first_checkpoint_runs_that_retry_again_probe_included() -> None:
    r, history, retry = _probed_retry("crashed", error="worker died", pending_probe=None)
    probing = replace(history[1], pending_probe=retry.lr_probe)  # it died inside the probe: no choice recorded
    p = plan(r, [history[0], probing], EVERY_100)
    assert p.kind == "crash_restart"
    assert (p.resume_from, p.resume_step) == (retry.resume_from, 800)
    assert (p.rewarm_steps, p.lr_probe, p.overrides) == (20, retry.lr_probe, retry.overrides)
    assert p.reason == (
        "attempt 2 crashed (worker died); resumed from step 800 with unchanged settings; it crashed before its "
        "first checkpoint, so again re-warm 20 steps and lr probe of 0.0015, 0.000375, 9.375e-05 for 100 steps each "
        "(the re-warm goes if the chosen LR trains cleanly)"
    )
    # the probe had chosen (its LR is in the overrides) before the crash: the re-warm again, no second probe
    chosen = plan(r, history, EVERY_100)
    assert (chosen.resume_step, chosen.rewarm_steps, chosen.lr_probe) == (800, 20, None)
    assert chosen.reason.endswith("so again re-warm 20 steps")


def test_a_crash_after_the_retrys_first_checkpoint_resumes_there_without_re_warm_or_probe() -> None:
    r, history, retry = _probed_retry("crashed", error="worker died", pending_probe=None)
    mid_probe = replace(history[1], pending_probe=retry.lr_probe)
    own = [CheckpointRecord(20, 2, 850, "file:///ck/2/850", healthy=True)]
    for last in (history[1], mid_probe):
        p = plan(r, [history[0], last], EVERY_100 + own)
        assert (p.resume_from, p.rewarm_steps, p.lr_probe) == (own[0], 0, None)
        assert p.reason == "attempt 2 crashed (worker died); resumed from step 850 with unchanged settings"


def test_crash_reason_is_one_line_with_a_tracebacks_exception() -> None:
    err = "Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: CUDA out of memory\n"
    p = plan(recipe(), [crashed(error=err)], EVERY_100)
    assert "(RuntimeError: CUDA out of memory)" in p.reason and "\n" not in p.reason


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("outcome", ["succeeded", "cancelled", "config_error"])
def test_nothing_to_recover_is_a_caller_error(outcome: str) -> None:
    with pytest.raises(ValueError, match="history\\[-1\\].outcome"):
        decide(recipe(), [AttemptRecord(1, "initial", outcome, 0)], [])


def test_empty_history_is_refused() -> None:
    with pytest.raises(ValueError, match="history: empty"):
        decide(recipe(), [], [])


@pytest.mark.parametrize(
    ("kw", "field"),
    [({"kind": "retry"}, "kind"), ({"outcome": "exploded"}, "outcome"), ({"number": 0}, "number"),
     ({"start_step": -1}, "start_step")],
)
def test_bad_attempt_records_name_the_field(kw: dict[str, Any], field: str) -> None:
    args: dict[str, Any] = {"number": 1, "kind": "initial", "outcome": "diverged", "start_step": 0, **kw}
    with pytest.raises(ValueError, match=f"AttemptRecord.{field}"):
        AttemptRecord(**args)


def test_malformed_overrides_name_the_path() -> None:
    with pytest.raises(ValueError, match="overrides.optimizer.lr"):
        normalize_overrides({"optimizer.lr": [1, 2, 3]})


# -------------------------------------------------------------------------------------------- serialisation
def test_plan_json_forms_and_effective_values() -> None:
    r = recipe(precision={"dtype": "fp16"}, recovery={"skip_data_window": True})
    p = plan(r, [diverged(1, 812, loss_scale_collapsed=True)], EVERY_100)
    assert p.overrides_json() == {"precision.dtype": ["fp16", "bf16"]}
    assert p.plan_json() == {"rewarm_steps": 0, "data_offset": 13, "resume_uri": "file:///ck/1/800"}
    values = effective_values(r, p.overrides_json())
    assert values["optimizer.lr"] == 1e-3 and values["precision.dtype"] == "bf16"
    assert effective_values(r, None)["precision.dtype"] == "fp16"


# ------------------------------------------------------------------------------------------------- property
@settings(max_examples=150, deadline=None)
@given(
    onsets=st.lists(st.integers(0, 1000), min_size=1, max_size=5),
    healthy=st.lists(st.booleans(), min_size=11, max_size=11),
    valid=st.lists(st.booleans(), min_size=11, max_size=11),
    margin=st.integers(0, 300),
    order=st.sampled_from(["auto", "lr_first", "clip_first", "both"]),
    sgd=st.booleans(),
)
def test_retries_never_loosen_and_never_resume_past_the_margin(
    onsets: list[int], healthy: list[bool], valid: list[bool], margin: int, order: str, sgd: bool
) -> None:
    r = recipe(optimizer={"name": "sgd" if sgd else "adamw"},
               recovery={"rollback_margin_steps": margin, "tighten_order": order, "max_retries": 10})
    checkpoints = [CheckpointRecord(i + 1, 1, i * 100, f"u{i}", healthy[i], valid[i]) for i in range(11)]
    history = [diverged(1, onsets[0])]
    for n, onset in enumerate(onsets[1:], start=2):
        out = decide(r, history, checkpoints)
        if isinstance(out, GiveUp):
            return
        history.append(follow(history[-1], out, n, onset=max(onset, out.resume_step)))
    out = decide(r, history, checkpoints)
    if isinstance(out, GiveUp):
        return
    prev = effective_values(r, history[-1].overrides)
    new = effective_values(r, out.overrides_json())
    assert new["optimizer.lr"] <= prev["optimizer.lr"]
    assert new["clipping.max_norm"] <= prev["clipping.max_norm"]
    assert (new["optimizer.lr"], new["clipping.max_norm"]) != (prev["optimizer.lr"], prev["clipping.max_norm"])
    last_onset = history[-1].onset_step
    assert last_onset is not None
    if out.resume_from is not None:
        assert out.resume_from.healthy and out.resume_from.valid
        assert out.resume_step <= last_onset - margin


def test_restart_latest_strategy_resumes_the_newest_checkpoint_with_unchanged_settings() -> None:
    """The benchmark baseline: what Ray's FailureConfig does — newest valid checkpoint, healthy or not, same
    settings, no re-warm; it spends the numeric retry budget."""
    r = recipe(recovery={"strategy": "restart_latest", "max_retries": 1})
    ckpts = [CheckpointRecord(id=1, attempt_number=1, step=50, uri="u50", healthy=True),
             CheckpointRecord(id=2, attempt_number=1, step=100, uri="u100", healthy=False)]
    last = AttemptRecord(number=1, kind="initial", outcome="diverged", start_step=0, onset_step=90, final_step=101)
    p = decide(r, [last], ckpts)
    assert isinstance(p, RecoveryPlan)
    assert p.kind == "numeric_retry" and p.resume_from is not None and p.resume_from.id == 2
    assert p.overrides == {} and p.rewarm_steps == 0 and "restart_latest" in p.reason
    second = AttemptRecord(number=2, kind="numeric_retry", outcome="diverged", start_step=100, onset_step=120,
                           final_step=121, resumed_from_id=2)
    assert isinstance(decide(r, [last, second], ckpts), GiveUp)


# ------------------------------------------------------------------------ judgement: the knob the evidence names
def _ck(id_: int, step: int, loss: float | None, healthy: bool = True) -> CheckpointRecord:
    return CheckpointRecord(id_, 1, step, f"file:///ck/1/{step}", healthy, loss=loss)


@pytest.mark.parametrize(
    ("losses", "expected_step"),
    [
        ([2.0, 1.6, 1.9, 2.2], 100),    # the best, not the newest: 300 had already degraded
        ([2.0, 1.6, 1.6, 2.2], 200),    # ties: the newest of the best
        ([None, None, None, None], 300),  # nothing known: the newest (the old rule)
        ([2.0, None, 1.5, None], 200),  # unknown losses never win over known ones
    ],
)
def test_rollback_goes_to_the_best_healthy_checkpoint_before_the_onset(
    losses: list[float | None], expected_step: int
) -> None:
    checkpoints = [_ck(i + 1, s, x) for i, (s, x) in enumerate(zip([0, 100, 200, 300], losses, strict=True))]
    checkpoints.append(_ck(9, 400, 0.1))  # after the onset: never
    p = plan(recipe(), [diverged(1, 350)], checkpoints)
    assert p.resume_step == expected_step
    if expected_step != 300 and losses[-1] is not None:
        assert "not the newest" in p.reason


def test_vanishing_gives_up_with_the_diagnosis_after_at_most_one_look() -> None:
    for kind in ("vanishing", "vanishing_gradients"):
        out = give_up(recipe(), [diverged(1, 300, detector=kind)], EVERY_100)
        assert "vanishing" in out.reason and "cannot be fixed by tightening" in out.reason


def test_overfitting_gives_up_with_the_diagnosis_without_a_retry() -> None:
    """The held-out loss rose while the training loss fell: a lower LR or clip threshold is not the fix."""
    out = give_up(recipe(), [diverged(1, 300, detector="overfitting")], EVERY_100)
    assert "overfitting is not fixed by tightening" in out.reason and "regularise" in out.reason
    assert plan(recipe(), [diverged(1, 300, detector="eval_degraded")], EVERY_100).resume_step <= 300  # retried


@pytest.mark.parametrize(
    ("schedule", "onset", "warmup_override", "text"),
    [
        ({}, 3, (None, 200), "added a 200-step warmup"),               # early, no warmup: add one
        ({"warmup_steps": 100}, 120, (100, 200), "warmup 100→200"),    # right after the warmup: lengthen it
        ({"warmup_fraction": 0.05}, 90, (None, 200), "warmup 100→200"),  # fraction form: set steps, drop fraction
        ({"warmup_steps": 100}, 900, None, None),                      # long after the warmup: leave it
        ({}, 812, None, None),                                          # late, no warmup: re-warm only
    ],
)
def test_warmup_rules(schedule: dict[str, Any], onset: int, warmup_override: tuple[Any, Any] | None,
                      text: str | None) -> None:
    r = recipe(schedule=schedule)
    p = plan(r, [diverged(1, onset)], cps(1, [0]))
    assert p.overrides.get("schedule.warmup_steps") == warmup_override
    if "warmup_fraction" in schedule:
        assert p.overrides["schedule.warmup_fraction"] == (0.05, None)
    if text is not None:
        assert text in p.reason
        assert "optimizer.lr" in p.overrides  # a too-high peak is lowered as well


def test_no_progress_or_an_early_blow_up_lowers_the_lr_by_the_factor_squared() -> None:
    r = recipe(optimizer={"lr": 0.01})
    never = plan(r, [diverged(1, 0, detector="never_learned")], cps(1, [0]))
    assert never.overrides["optimizer.lr"] == (0.01, pytest.approx(0.0025))
    early = plan(r, [diverged(1, 4, detector="divergence")], cps(1, [0]))
    assert early.overrides["optimizer.lr"] == (0.01, pytest.approx(0.0025))
    late = plan(r, [diverged(1, 812, detector="divergence")], EVERY_100)
    assert late.overrides["optimizer.lr"] == (0.01, pytest.approx(0.005))


@pytest.mark.parametrize("kind", ["stalled", "collapsed"])
def test_a_stalled_run_starts_again_from_initialisation_with_the_lr_cut_by_the_factor_squared(kind: str) -> None:
    """A stall far from the floor, or gradients that collapsed near the start (the verdict's onset: the attempt's
    start), is a run that never really learned at its LR: the checkpoints it wrote do not qualify, and the LR moves
    like after never learning. A loss kind: the LR goes first even for SGD, whose fallback is the clip."""
    r = recipe(optimizer={"name": "sgd", "lr": 0.2}, clipping={"method": "none"})
    stalled = plan(r, [diverged(1, 0, detector=kind)], EVERY_100)
    assert stalled.resume_step == 0 and (stalled.resume_from is None or stalled.resume_from.step == 0)
    assert stalled.overrides["optimizer.lr"] == (0.2, pytest.approx(0.05))
    assert "clipping.method" not in stalled.overrides  # a loss kind: the LR goes first

