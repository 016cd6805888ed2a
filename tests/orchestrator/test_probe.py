"""Table tests of the LR probe's policy rules: which LRs a retry probes, and how the probe's result becomes the
attempt's settings (``orchestrator/policy/probe.py``)."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import pytest

from contracts.recipe import ProbeMode, RecipeError, load_recipe
from contracts.wire import AttemptSpec, ProbePlan
from orchestrator.policy.probe import apply_probe_result, probe_plan, refine_above, replay_steps, upward_lrs
from orchestrator.policy.recovery import AttemptRecord, RecoveryPlan, decide
from orchestrator.policy.tightening import LR, MAX_NORM, METHOD, WARMUP, WARMUP_FRACTION, Change
from tests.recipes import build_recipe

recipe = partial(build_recipe, {"name": "t"})


def probe_recipe(max_steps: int = 2000, **probe: Any) -> Any:
    return recipe(training={"max_steps": max_steps}, optimizer={"lr": 1e-2}, recovery={"lr_probe": probe})


CUTS = (5e-3, 1.25e-3, 3.125e-4)


def cut(lr: float) -> list[Change]:
    return [Change(LR, lr)]


@pytest.mark.parametrize(
    ("max_steps", "probe", "expected", "steps"),
    [
        # auto: on when candidates x steps <= max_fraction (0.2) x max_steps; steps default to an equal share of
        # that fifth, between 10 and 100
        (150, {}, CUTS, 10),
        (149, {}, None, None),
        (600, {}, CUTS, 40),
        (100_000, {}, CUTS, 100),
        (100, {"mode": "on"}, CUTS, 10),
        (100_000, {"mode": "off"}, None, None),
        (150, {"steps": 11}, None, None),  # 33 > 30
        (300, {"steps": 20}, CUTS, 20),
        (400, {"max_fraction": 0.05}, None, None),  # the 10-step floor: 30 > 20
        (1000, {"max_fraction": 0.05}, CUTS, 16),
        (2000, {"max_fraction": 0.05}, CUTS, 33),
        (2000, {"candidates": 2, "spacing": 0.1}, (5e-3, 5e-4), 100),
    ],
)
def test_which_lrs_a_retry_probes(max_steps: int, probe: dict[str, Any], expected: tuple[float, ...] | None,
                                  steps: int | None) -> None:
    got = probe_plan(probe_recipe(max_steps, **probe), cut(5e-3))
    if expected is None:
        assert got is None
    else:
        assert got is not None and got.candidates == pytest.approx(expected) and got.steps == steps


def test_candidates_stop_at_the_lr_floor() -> None:
    r = build_recipe({"name": "t", "training": {"max_steps": 2000},
                      "recovery": {"min_lr": 1e-4, "lr_probe": {"mode": "on", "candidates": 4}}})
    got = probe_plan(r, cut(1e-3))
    assert got is not None and got.candidates == pytest.approx((1e-3, 2.5e-4, 1e-4))  # the floor is the last
    assert probe_plan(r, cut(1e-4)) is None  # the cut LR is at the floor: nothing lower to compare with


def test_no_probe_when_the_retry_leaves_the_lr_alone() -> None:
    assert probe_plan(probe_recipe(mode="on"), []) is None
    assert probe_plan(probe_recipe(mode="on"), [Change(MAX_NORM, 0.5)]) is None


@pytest.mark.parametrize(
    ("schedule", "changes", "if_clean"),
    [
        # an added warmup (the schedule had none) goes back to none on a clean pick
        ({}, [Change(WARMUP, 15)], {WARMUP: None}),
        ({"warmup_steps": 0}, [Change(WARMUP, 15)], {WARMUP: 0}),
        ({"warmup_fraction": 0.0}, [Change(WARMUP, 15), Change(WARMUP_FRACTION, None)],
         {WARMUP: None, WARMUP_FRACTION: 0.0}),
        # a lengthened warmup stays: the divergence came during or right after the recipe's own warmup
        ({"warmup_steps": 30}, [Change(WARMUP, 60)], {}),
        ({}, [], {}),
    ],
)
def test_a_probe_takes_back_only_a_warmup_the_retry_added(schedule: dict[str, Any], changes: list[Change],
                                                          if_clean: dict[str, Any]) -> None:
    r = recipe(training={"max_steps": 2000}, schedule=schedule, recovery={"lr_probe": {"mode": "on"}})
    got = probe_plan(r, [Change(LR, 1e-4), *changes])
    assert got is not None and got.if_clean == if_clean
    assert ProbePlan.from_plan({"lr_probe": got.to_dict()}) == got  # it travels with the plan


def test_an_early_divergence_retry_plans_to_drop_its_ramps_on_a_clean_pick() -> None:
    r = recipe(training={"max_steps": 2000}, optimizer={"lr": 1e-2}, schedule={"warmup_steps": 0},
               recovery={"lr_probe": {"mode": "on"}})
    history = [AttemptRecord(number=1, kind="initial", outcome="diverged", start_step=0, onset_step=3,
                             final_step=4, detector="divergence")]
    p = decide(r, history, [])
    assert isinstance(p, RecoveryPlan) and p.overrides[WARMUP] == (0, 200)
    assert p.lr_probe is not None and p.lr_probe.if_clean == {WARMUP: 0}
    assert p.plan_json()["lr_probe"]["if_clean"] == {WARMUP: 0}
    assert "(the re-warm and the added warmup go if the chosen LR trains cleanly)" in p.reason


def test_a_retry_that_cuts_the_lr_probes_from_the_cut_lr_and_says_so() -> None:
    r = probe_recipe(mode="on")
    history = [AttemptRecord(number=1, kind="initial", outcome="diverged", start_step=0, onset_step=900,
                             final_step=901, detector="loss_spike")]
    p = decide(r, history, [])
    assert isinstance(p, RecoveryPlan)
    assert p.overrides["optimizer.lr"] == (1e-2, 5e-3)
    assert p.lr_probe is not None and p.lr_probe.candidates == pytest.approx((5e-3, 1.25e-3, 3.125e-4))
    assert p.plan_json()["lr_probe"] == {"candidates": list(p.lr_probe.candidates), "steps": 100}
    assert "lr probe of 0.005, 0.00125, 0.0003125 for 100 steps each (the re-warm goes" in p.reason


@pytest.mark.parametrize(
    ("detector", "onset", "final_step", "replayed"),
    [
        ("nonfinite", 3, 3, True),        # stopped 3 steps in: a 10-step probe replays through that step
        ("nonfinite", 2, 9, True),        # the last step the probe reaches
        ("nonfinite", 2, 10, True),       # one past it: the replay trains 11 steps, through the step that failed
        ("nonfinite", 2, 29, True),       # 30 steps: as many as the three cut candidates' whole probe
        ("nonfinite", 2, 30, False),      # one more than the probe it would replace: the cuts are cheaper
        ("loss_spike", 5, 6, True),
        ("divergence", 2, 3, False),      # the loss's level rose: a trend that a replay reproduces
        ("grad_norm_spike", 5, 6, True),  # early, during the warmup: the peak is lowered too, so it probes
        ("stalled", 0, 5, False),         # a verdict over the whole run: a few steps cannot replay it
        ("never_learned", 0, 5, False),
    ],
)
def test_a_first_retry_replays_the_diverged_settings_when_the_probe_reaches_the_failed_step(
    detector: str, onset: int, final_step: int, replayed: bool
) -> None:
    r = recipe(training={"max_steps": 150}, optimizer={"lr": 3e-3}, schedule={"warmup_steps": 10})
    history = [AttemptRecord(number=1, kind="initial", outcome="diverged", start_step=0, onset_step=onset,
                             final_step=final_step, detector=detector)]
    p = decide(r, history, [])
    assert isinstance(p, RecoveryPlan)
    probe = p.lr_probe
    if not replayed:
        assert probe is None or (not probe.replay and 3e-3 not in probe.candidates)  # the ended LR is not tried
        return
    assert probe is not None and probe.steps == 10 and probe.replay_steps == final_step + 1
    assert [probe.steps_of(i) for i in range(len(probe.candidates))] == [final_step + 1] + [10] * 3
    assert probe.candidates[0] == 3e-3 and probe.candidates[1] == p.overrides[LR][1]  # the replay, then the cuts
    assert probe.replay == {path: r.model_dump()[path.split(".")[0]][path.split(".")[1]] for path in p.overrides}
    assert probe.replay[LR] == 3e-3 and probe.replay[WARMUP] == 10  # the warmup the retry lengthened, as it was
    assert p.plan_json()["lr_probe"]["replay"] == probe.replay
    assert ProbePlan.from_plan(p.plan_json()) == probe
    assert f"the first replays the diverged settings through the step that failed ({final_step + 1} steps" in p.reason


@pytest.mark.parametrize(("detector", "clip_too"), [("loss_spike", True), ("nonfinite", True), ("divergence", False)])
def test_a_replay_is_the_recurrence_test_so_the_cut_candidates_turn_the_clip_too(detector: str, clip_too: bool) -> None:
    """A loss divergence lowers the LR first and the clip only when it recurs. A first retry that replays the ended
    settings learns in its probe whether it recurs: the candidates after the replay train only if it did, so they
    carry the clip as well, and the replay reverts it with every other change. Without a replay (a level that
    rose: a trend) the first retry moves the LR alone."""
    r = recipe(training={"max_steps": 150}, optimizer={"lr": 3e-3}, schedule={"warmup_steps": 10},
               clipping={"method": "none"})
    history = [AttemptRecord(number=1, kind="initial", outcome="diverged", start_step=0, onset_step=5,
                             final_step=6, detector=detector)]
    p = decide(r, history, [])
    assert isinstance(p, RecoveryPlan) and p.overrides[LR][1] < 3e-3
    assert (METHOD in p.overrides) is clip_too
    probe = p.lr_probe
    assert probe is not None and bool(probe.replay) is clip_too
    if clip_too:
        assert p.overrides[METHOD] == ("none", "global_norm")
        assert probe.replay[METHOD] == "none" and probe.replay[LR] == 3e-3  # the replay is the ended attempt
        assert "clipping none→global_norm at 1.0 (with the cut LR, should the replay show it recurs)" in p.reason


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        ({}, 3),
        ({"used": 1}, None),               # a replay was already offered (and, if chosen, diverged again)
        ({"skip_data_window": True}, None),  # the retry's batches differ: no replay
        ({"detector": "oscillation"}, None),
        ({"detector": "divergence"}, None),
        ({"stopped_at": None}, None),
        ({"resume_step": 2}, 1),
    ],
)
def test_replay_steps(kw: dict[str, Any], expected: int | None) -> None:
    args: dict[str, Any] = {"detector": "nonfinite", "stopped_at": 3, "resume_step": 0, "used": 0,
                            "skip_data_window": False, **kw}
    assert replay_steps(args.pop("detector"), args.pop("stopped_at"), **args) == expected


def test_a_chosen_replay_takes_every_change_of_the_retry_back() -> None:
    """The worker kept the replayed settings: the attempt's overrides say it trains as the ended attempt did."""
    overrides = {"optimizer.lr": [3e-3, 7.5e-4], WARMUP: [10, 20]}
    result = {**RESULT, "chosen": 3e-3, "rewarm_steps": 0, "if_clean": {"optimizer.lr": 3e-3, WARMUP: 10}}
    applied = apply_probe_result(overrides, PLAN, "r", result)
    assert applied is not None
    new_overrides, new_plan, _ = applied
    assert new_overrides == {} and new_plan["rewarm_steps"] == 0 and new_plan["lr_probe"]["chosen"] == 3e-3


def test_a_clip_only_retry_does_not_probe() -> None:
    """A gradient spike with a healthy loss tightens the clip first: the LR is unchanged, so there is no probe."""
    r = probe_recipe(mode="on")
    history = [AttemptRecord(number=1, kind="initial", outcome="diverged", start_step=0, onset_step=900,
                             final_step=901, detector="grad_norm_spike")]
    p = decide(r, history, [])
    assert isinstance(p, RecoveryPlan) and "optimizer.lr" not in p.overrides
    assert p.lr_probe is None and "lr_probe" not in p.plan_json()


def test_a_crash_restart_does_not_probe() -> None:
    r = probe_recipe(mode="on")
    history = [AttemptRecord(number=1, kind="initial", outcome="crashed", start_step=0, error="worker died")]
    p = decide(r, history, [])
    assert isinstance(p, RecoveryPlan) and p.lr_probe is None


RESULT = {"chosen": 1.25e-3, "steps_run": 66, "reason": "lr probe from step 800: …; chose 0.00125 (lowest loss)",
          "candidates": [{"lr": 5e-3, "score": None, "failed": "divergence at step 805", "steps": 6},
                         {"lr": 1.25e-3, "score": 0.5, "failed": None, "steps": 30},
                         {"lr": 3.125e-4, "score": 0.7, "failed": None, "steps": 30}]}
PLAN = {"rewarm_steps": 20, "data_offset": 0, "resume_uri": "file:///c", "lr_probe": {"candidates": [5e-3, 1.25e-3,
                                                                                                     3.125e-4],
                                                                                      "steps": 30}}


def test_the_probe_result_becomes_the_attempts_lr_plan_and_reason() -> None:
    overrides = {"optimizer.lr": [1e-2, 5e-3], "clipping.max_norm": [1.0, 0.5]}
    applied = apply_probe_result(overrides, PLAN, "attempt 1 diverged; lr 0.01→0.005", RESULT)
    assert applied is not None
    new_overrides, new_plan, reason = applied
    assert new_overrides == {"optimizer.lr": [1e-2, 1.25e-3], "clipping.max_norm": [1.0, 0.5]}
    assert new_plan["lr_probe"]["chosen"] == 1.25e-3 and new_plan["lr_probe"]["steps_run"] == 66
    assert new_plan["lr_probe"]["candidates"] == [5e-3, 1.25e-3, 3.125e-4]  # the plan's, kept
    assert new_plan["lr_probe"]["candidates_run"][0]["failed"] == "divergence at step 805"
    assert new_plan["rewarm_steps"] == 20
    assert reason == "attempt 1 diverged; lr 0.01→0.005; lr probe from step 800: …; chose 0.00125 (lowest loss)"
    assert overrides == {"optimizer.lr": [1e-2, 5e-3], "clipping.max_norm": [1.0, 0.5]}  # the inputs untouched
    # recorded once: a redelivered event (or the end event carrying it again) changes nothing
    assert apply_probe_result(new_overrides, new_plan, reason, RESULT) is None


def test_a_clean_pick_takes_back_the_retrys_ramps() -> None:
    """The worker reports that the chosen LR trained cleanly and it dropped the re-warm and the added warmup: the
    attempt's plan and overrides say what it really trained with, for a crash restart and the next retry."""
    overrides = {"optimizer.lr": [1e-2, 5e-3], WARMUP: [None, 15], "clipping.max_norm": [1.0, 0.5]}
    clean = {**RESULT, "rewarm_steps": 0, "if_clean": {WARMUP: None}}
    applied = apply_probe_result(overrides, PLAN, "r", clean)
    assert applied is not None
    new_overrides, new_plan, _ = applied
    assert new_overrides == {"optimizer.lr": [1e-2, 1.25e-3], "clipping.max_norm": [1.0, 0.5]}
    assert new_plan["rewarm_steps"] == 0 and PLAN["rewarm_steps"] == 20
    # a value other than the original stays an override
    applied = apply_probe_result({WARMUP: [5, 15]}, PLAN, "r", {**clean, "if_clean": {WARMUP: 0}})
    assert applied is not None and applied[0] == {WARMUP: [5, 0]}
    # without the worker's word (every candidate failed), the ramps stay
    applied = apply_probe_result(overrides, PLAN, "r", RESULT)
    assert applied is not None and applied[0][WARMUP] == [None, 15] and applied[1]["rewarm_steps"] == 20


@pytest.mark.parametrize("chosen", [None, "0.1", True])
def test_a_result_without_a_chosen_lr_changes_nothing(chosen: Any) -> None:
    assert apply_probe_result({"optimizer.lr": [1e-2, 5e-3]}, PLAN, "r", {**RESULT, "chosen": chosen}) is None


def test_a_plan_whose_probe_ran_launches_without_one() -> None:
    """A relaunch of an attempt whose probe already ran trains at the chosen LR (in its overrides) at once."""
    assert ProbePlan.from_plan(PLAN) == ProbePlan(candidates=(5e-3, 1.25e-3, 3.125e-4), steps=30)
    assert ProbePlan.from_plan({**PLAN, "lr_probe": {**PLAN["lr_probe"], "chosen": 1.25e-3}}) is None
    assert ProbePlan.from_plan({"rewarm_steps": 0}) is None and ProbePlan.from_plan(None) is None


def test_the_probe_travels_with_the_spec() -> None:
    spec = AttemptSpec(recipe=recipe(), checkpoint_dir="/tmp/x", lr_probe=ProbePlan((1e-3, 1e-4), 10))
    back = AttemptSpec.from_dict(spec.to_dict())
    assert back.lr_probe == ProbePlan((1e-3, 1e-4), 10)
    assert AttemptSpec.from_dict({**spec.to_dict(), "lr_probe": None}).lr_probe is None


@pytest.mark.parametrize(("candidates", "steps"), [((1e-3,), 10), ((1e-3, 0.0), 10), ((1e-3, 1e-4), 0),
                                                   ((1e-3, float("nan")), 10)])
def test_a_malformed_probe_plan_is_refused(candidates: tuple[float, ...], steps: int) -> None:
    with pytest.raises(ValueError, match="ProbePlan"):
        ProbePlan(candidates, steps)


def test_a_replay_has_steps_of_its_own_and_a_plan_stored_before_them_replays_a_candidates_steps() -> None:
    with pytest.raises(ValueError, match="ProbePlan.replay_steps"):
        ProbePlan((1e-3, 1e-4), 10, replay={"optimizer.lr": 1e-3})
    plan = ProbePlan((1e-3, 1e-4), 10, replay={"optimizer.lr": 1e-3}, replay_steps=17)
    assert ProbePlan.from_plan({"lr_probe": plan.to_dict()}) == plan and plan.to_dict()["replay_steps"] == 17
    older = {"lr_probe": {"candidates": [1e-3, 1e-4], "steps": 10, "replay": {"optimizer.lr": 1e-3}}}
    assert ProbePlan.from_plan(older) == ProbePlan((1e-3, 1e-4), 10, replay={"optimizer.lr": 1e-3}, replay_steps=10)


@pytest.mark.parametrize(("text", "mode"), [("on", ProbeMode.on), ("off", ProbeMode.off), ("auto", ProbeMode.auto),
                                            ("'on'", ProbeMode.on), ("true", ProbeMode.on)])
def test_a_bare_yaml_on_or_off_is_the_mode_it_spells(text: str, mode: ProbeMode) -> None:
    """YAML 1.1 reads ``on`` as true: the recipe still means the mode."""
    recipe = load_recipe(f"apiVersion: ballast/v1\nkind: StabilityRecipe\nname: t\nrecovery:\n  lr_probe:\n"
                         f"    mode: {text}\n")
    assert recipe.recovery.lr_probe.mode is mode


def test_a_bad_mode_names_the_field() -> None:
    with pytest.raises(RecipeError, match="recovery.lr_probe.mode"):
        load_recipe("apiVersion: ballast/v1\nkind: StabilityRecipe\nname: t\nrecovery:\n  lr_probe:\n"
                    "    mode: sometimes\n")


def test_ballast_train_tells_the_policy_a_probe_it_did_not_finish() -> None:
    """``ballast train``'s attempt record (``LocalAttempt.record``) carries the plan's re-warm and, until the probe
    reports a choice, the probe, as the store's ``attempt_record`` does: a crash mid-probe is restarted into it."""
    from api.cli.local_run import Ended, LocalAttempt, LocalRun

    probe = ProbePlan((1e-3, 2.5e-4), 10)
    spec = AttemptSpec(recipe=recipe(), checkpoint_dir="/tmp/x", lr_probe=probe, rewarm_steps=20)
    attempt = LocalAttempt(number=2, kind="numeric_retry", spec=spec, overrides={"optimizer.lr": [4e-3, 1e-3]},
                           ended=Ended("crashed", None, {}, error="boom"))
    assert (attempt.record().rewarm_steps, attempt.record().pending_probe) == (20, probe)
    LocalRun._record_probe(attempt, {"chosen": 2.5e-4, "steps_run": 20, "candidates": []})
    assert attempt.record().pending_probe is None and attempt.overrides["optimizer.lr"] == [4e-3, 2.5e-4]
    assert attempt.record().rewarm_steps == 20  # no clean pick reported: the re-warm stays


def test_ballast_train_records_a_clean_pick_without_its_re_warm() -> None:
    from api.cli.local_run import Ended, LocalAttempt, LocalRun

    spec = AttemptSpec(recipe=recipe(), checkpoint_dir="/tmp/x", lr_probe=ProbePlan((1e-3, 2.5e-4), 10),
                       rewarm_steps=20)
    attempt = LocalAttempt(number=2, kind="numeric_retry", spec=spec, overrides={"optimizer.lr": [4e-3, 1e-3]},
                           ended=Ended("crashed", None, {}, error="boom"))
    LocalRun._record_probe(attempt, {"chosen": 2.5e-4, "steps_run": 20, "candidates": [], "rewarm_steps": 0})
    assert attempt.record().rewarm_steps == 0 and attempt.to_dict([])["rewarm_steps"] == 0


@pytest.mark.parametrize(
    ("detector", "diverged_lrs", "expected"),
    [
        ("never_learned", (), (4e-2, 0.16, 0.64)),  # the ended LR / spacing, and on up: three
        ("never_learned", (0.5,), (4e-2, 0.16)),     # each below an LR that diverged for another reason
        ("never_learned", (0.16,), (4e-2,)),         # not at one: known to be too high
        ("never_learned", (4e-2, 1.0), ()),
        ("stalled", (), ()),                         # a stall and a collapse say the LR was too high
        ("collapsed", (), ()),
        ("divergence", (), ()),
        ("nonfinite", (), ()),
        (None, (), ()),
    ],
)
def test_upward_lrs(detector: str | None, diverged_lrs: tuple[float, ...], expected: tuple[float, ...]) -> None:
    assert upward_lrs(detector, 1e-2, 0.25, diverged_lrs, 3) == pytest.approx(expected)


def test_no_upward_lr_above_what_a_recipe_may_hold() -> None:
    assert upward_lrs("never_learned", 2.0, 0.25, (), 6) == pytest.approx((8.0, 32.0))  # 128 > MAX_LR (100)
    assert upward_lrs("never_learned", 30.0, 0.25, (), 6) == ()


def test_an_upward_candidate_takes_the_lowest_cuts_place_and_the_rest_extend_the_probe() -> None:
    got = probe_plan(probe_recipe(mode="on"), cut(2.5e-3), upward=(4e-2, 0.16))
    assert got is not None and got.candidates == pytest.approx((4e-2, 2.5e-3, 6.25e-4))  # still three candidates
    assert got.extend == (0.16,) and got.max_steps == 3 * got.steps  # the first two and the extension, at most
    assert ProbePlan.from_plan({"lr_probe": got.to_dict()}) == got  # it travels with the plan
    two = probe_plan(probe_recipe(mode="on", candidates=2), cut(2.5e-3), upward=(4e-2,))
    assert two is not None and two.candidates == (4e-2, 2.5e-3) and two.extend == ()


@pytest.mark.parametrize(
    ("plan", "expected"),
    [
        (ProbePlan(candidates=(0.1, 0.025, 0.00625), steps=10), 30),
        (ProbePlan(candidates=(0.1, 0.025, 0.00625), steps=10, extend=(0.2,)), 30),  # the third, or the extension
        (ProbePlan(candidates=(0.1, 0.025, 0.00625), steps=10, extend=(0.4, 1.6, 6.4)), 50),
        (ProbePlan(candidates=(0.1, 0.025), steps=10, extend=(0.2,)), 30),
        (ProbePlan(candidates=(1.0, 0.25, 0.0625), steps=10, replay={LR: 1.0}, replay_steps=25), 45),
    ],
)
def test_the_most_steps_a_probe_can_train(plan: ProbePlan, expected: int) -> None:
    """Every candidate, or (an extension runs only when the first beat the second, which ends the descent) the
    first two and every extension: what the step budget reserves."""
    assert plan.max_steps == expected


@pytest.mark.parametrize("extend", [(1e-3,), (0.2, 0.1), (math.inf,)])
def test_an_extension_must_climb_above_every_candidate(extend: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="ProbePlan.extend"):
        ProbePlan(candidates=(0.1, 0.01), steps=10, extend=extend)


def never_learned(number: int, overrides: dict[str, Any] | None = None, detector: str = "never_learned") -> Any:
    return AttemptRecord(number=number, kind="initial" if number == 1 else "numeric_retry", outcome="diverged",
                         start_step=0, onset_step=0, final_step=500, detector=detector, overrides=overrides or {})


def test_a_run_that_never_learned_probes_above_its_lr_too_and_says_why() -> None:
    p = decide(probe_recipe(mode="on"), [never_learned(1)], [])
    assert isinstance(p, RecoveryPlan) and p.lr_probe is not None
    assert p.overrides["optimizer.lr"] == (1e-2, 2.5e-3)  # the cut stands until the probe chooses
    assert p.lr_probe.candidates == pytest.approx((4e-2, 2.5e-3, 6.25e-4))
    assert p.lr_probe.extend == pytest.approx((0.16, 0.64, 2.56, 10.24, 40.96))  # up to twice the candidates
    assert "the first, 0.04, is above the attempt's LR: a run that never learned may have trained too" in p.reason
    assert "then 0.16, 0.64, 2.56, 10.24, 40.96 while the highest tried is the best" in p.reason


def test_a_cut_back_to_the_recipes_own_lr_still_records_the_lr_the_probe_chooses() -> None:
    """Attempt 2 trained at 4e-2 (an upward pick) and never learned either: the cut is 1e-2, the recipe's own LR. The
    plan keeps an LR override for the probe's choice to replace, else the record would say the attempt trained at
    the recipe's LR whatever the probe chose."""
    p = decide(probe_recipe(mode="on"), [never_learned(1), never_learned(2, {"optimizer.lr": (1e-2, 4e-2)})], [])
    assert isinstance(p, RecoveryPlan) and p.lr_probe is not None and p.overrides[LR] == (1e-2, 1e-2)
    applied = apply_probe_result(p.overrides, p.plan_json(), p.reason, {"chosen": 0.16, "steps_run": 40})
    assert applied is not None and applied[0][LR] == [1e-2, 0.16]


def test_no_upward_candidate_reaches_an_lr_that_diverged_before() -> None:
    """Attempt 1 diverged at 1e-2 (a blow-up), attempt 2 at the cut 2.5e-3 never learned: 4x that is 1e-2, known to
    blow up, so the probe tries only cuts."""
    history = [never_learned(1, detector="divergence"), never_learned(2, {"optimizer.lr": (1e-2, 2.5e-3)})]
    p = decide(probe_recipe(mode="on"), history, [])
    assert isinstance(p, RecoveryPlan) and p.lr_probe is not None
    assert max(p.lr_probe.candidates) < 2.5e-3 and "above the attempt's LR" not in p.reason


@pytest.mark.parametrize(
    ("detector", "stopped_after", "expected"),
    [
        ("divergence", 7, (0.5,)),       # the geometric mean of the cut (0.25) and the LR that failed (1.0)
        ("loss_spike", 9, (0.5,)),       # its 10th step: a candidate's 10 steps would have seen it fail
        ("nonfinite", 0, (0.5,)),        # its first step
        ("divergence", 10, ()),          # past the span: a clean short run vouches for nothing there
        ("divergence", -1, ()),
        ("divergence", None, ()),
        ("stalled", 200, ()),            # an end judged over a whole run is never within a probe's span
        ("never_learned", 5, ()),        # looks above the ended LR itself (upward_lrs)
        (None, 5, ()),
    ],
)
def test_refine_above(detector: str | None, stopped_after: int | None, expected: tuple[float, ...]) -> None:
    assert refine_above(detector, 1.0, 0.25, stopped_after, 10) == pytest.approx(expected)


def test_no_refinement_unless_the_cut_lies_below_the_ended_lr() -> None:
    assert refine_above("divergence", 1.0, 1.0, 3, 10) == ()
    assert refine_above("divergence", 1.0, 2.0, 3, 10) == ()


def diverged_at(final_step: int, detector: str = "divergence") -> AttemptRecord:
    return AttemptRecord(number=1, kind="initial", outcome="diverged", start_step=0, onset_step=final_step,
                         final_step=final_step, detector=detector)


def test_an_early_divergence_probes_between_the_cut_and_the_lr_that_failed_and_says_why() -> None:
    """Diverged at step 6 from initialisation, within a 100-step probe's span: the retry's probe may try the LR
    between its cut (an early divergence: 4x, to 2.5e-3) and the one that failed (1e-2), should the cut score best."""
    p = decide(probe_recipe(mode="on"), [diverged_at(6)], [])
    assert isinstance(p, RecoveryPlan) and p.lr_probe is not None and p.lr_probe.replay == {}
    assert p.lr_probe.candidates == pytest.approx((2.5e-3, 6.25e-4, 1.5625e-4))
    assert p.lr_probe.extend == pytest.approx((5e-3,))  # the geometric mean of 2.5e-3 and 1e-2
    assert p.lr_probe.max_steps == 3 * p.lr_probe.steps  # it takes the lowest cut's place: the reservation stands
    assert "then 0.005, between the cut and the LR that failed, should the cut score best (the attempt failed at " \
           "step 7 from this start point, within the probe's span)" in p.reason
    assert ProbePlan.from_plan(p.plan_json()) == p.lr_probe


def test_a_late_divergence_or_a_replay_is_not_refined_above_the_cut() -> None:
    late = decide(probe_recipe(mode="on"), [diverged_at(900)], [])  # 900 steps from initialisation: past the span
    assert isinstance(late, RecoveryPlan) and late.lr_probe is not None and late.lr_probe.extend == ()
    assert "between the cut" not in late.reason
    replayed = decide(probe_recipe(mode="on"), [diverged_at(6, "loss_spike")], [])  # the replay tries 1e-2 itself
    assert isinstance(replayed, RecoveryPlan) and replayed.lr_probe is not None and replayed.lr_probe.replay
    assert replayed.lr_probe.extend == ()
