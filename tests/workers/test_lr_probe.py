"""The LR probe on the worker (``workers/lr_probe.py``): the choice rule as a table, and real probes in a plain
process: a candidate that blows up is found by the detectors and rejected, the attempt then trains exactly as one
started at the chosen LR without a probe would (the probe leaves no trace), from initialisation and from a
checkpoint, and the ``lr_probe`` event reports it before the first step."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from contracts.wire import AttemptSpec, ProbePlan
from tests.recipes import EXPLODING_RNN, build_recipe
from workers.entry import run_attempt
from workers.lr_probe import CandidateRun, choose, highest_is_best, past_the_best, with_lr
from workers.schedule import lr_at
from workers.sinks import ListSink


def runs(*spec: tuple[float, list[float], str | None]) -> list[CandidateRun]:
    return [CandidateRun(lr=lr, losses=tuple(losses), failed=failed) for lr, losses, failed in spec]


@pytest.mark.parametrize(
    ("candidates", "expected", "why"),
    [
        # the lowest score (mean of the last quarter of the losses) wins
        (runs((1e-2, [3, 2, 2, 1.0], None), (1e-3, [3, 2.5, 2, 1.5], None)), 0, "lowest loss"),
        (runs((1e-2, [3, 2, 2, 1.5], None), (1e-3, [3, 2.5, 2, 1.0], None)), 1, "lowest loss"),
        # a candidate the detectors would have rolled back is out, however low its losses before that
        (runs((1e-2, [3, 0.1], "loss_spike at step 1"), (1e-3, [3, 2.0], None)), 1, "lowest loss"),
        # however close: the lower score wins; an exact tie goes to the lower LR
        (runs((1e-2, [3, 1.0], None), (1e-3, [3, 1.001], None)), 0, "lowest loss"),
        (runs((1e-2, [3, 1.0], None), (1e-3, [3, 1.0], None)), 1, "lowest loss"),
        # negative losses (a custom objective) compare the same way
        (runs((1e-2, [0, -1.0], None), (1e-3, [0, -1.001], None)), 1, "lowest loss"),
        # a non-finite loss that no detector flagged is still no candidate
        (runs((1e-2, [3, math.inf], None), (1e-3, [3, 2.0], None)), 1, "lowest loss"),
        # every candidate failed: the lowest LR, the safest there is
        (runs((1e-2, [9.0], "nonfinite at step 0"), (1e-3, [9.0], "divergence at step 0")), 1, "every candidate"),
    ],
)
def test_choose(candidates: list[CandidateRun], expected: int, why: str) -> None:
    pick, reason = choose(candidates)
    assert pick == expected and reason.startswith(why)


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        (runs((4e-2, [3, 1.0], None), (1e-2, [3, 2.0], None)), True),
        (runs((1e-2, [3, 2.0], None), (4e-2, [3, 1.0], None)), True),   # the order tried does not matter
        (runs((4e-2, [3, 2.0], None), (1e-2, [3, 1.0], None)), False),  # a lower LR did better: the top is found
        (runs((4e-2, [3, 0.1], "loss_spike at step 1"), (1e-2, [3, 2.0], None)), False),  # the top failed
        (runs((4e-2, [9.0], "nonfinite"), (1e-2, [9.0], "nonfinite")), False),  # all failed: the lowest is chosen
    ],
)
def test_highest_is_best(candidates: list[CandidateRun], expected: bool) -> None:
    """Whether an upward probe climbs on (``ProbePlan.extend``)."""
    assert highest_is_best(candidates) is expected


@pytest.mark.parametrize(
    ("candidates", "expected"),
    [
        (runs((4e-2, [3, 1.0], None)), False),                                    # one tried: nothing to compare
        (runs((4e-2, [3, 1.0], None), (1e-2, [3, 2.0], None)), True),             # the lower LR did worse: stop
        (runs((4e-2, [3, 2.0], None), (1e-2, [3, 1.0], None)), False),            # it did better: descend on
        (runs((4e-2, [3, 0.1], "divergence"), (1e-2, [3, 2.0], None)), False),    # the top failed: descend on
        (runs((4e-2, [3, 2.0], None), (1e-2, [3, 1.0], None), (2.5e-3, [3, 1.5], None)), True),
        (runs((4e-2, [3, 1.0], None), (1e-2, [3, 9.0], "loss_spike")), True),     # a lower LR failed: stop
        (runs((4e-2, [3, 1.0], None), (1e-2, [3, 1.0], None)), False),            # a tie is not worse
    ],
)
def test_past_the_best(candidates: list[CandidateRun], expected: bool) -> None:
    """Whether the probe stops descending through its candidates (the steps go to its extension instead)."""
    assert past_the_best(candidates) is expected


LSQ: dict[str, Any] = {
    "name": "lsq-gd",
    "model": {"name": "linear"},
    "data": {"name": "regression", "dim": 16, "noise": 0.1, "condition": 10.0, "seed": 7, "fixed_design": True,
             "num_samples": 64},
    "training": {"max_steps": 30, "batch_size": 64, "seed": 0},
    "optimizer": {"name": "sgd", "lr": 0.2264, "momentum": 0.0},
    "schedule": {"warmup_steps": 0, "decay": "constant"},
    "clipping": {"method": "none"},
    "checkpoint": {"every_steps": 10},
    "success": {"min_progress": 0.0, "early_min_progress": 0.0},
}
"""Full-batch GD on a fixed-design least-squares problem whose MSE Hessian has lambda_max 2.4293, so GD is stable
below lr 0.8233 (the divergence benchmark's ``dev-lsq-sgd-beyond-limit``); 0.2264 is a quarter of 1.1x that limit."""


def test_a_cut_that_scores_best_is_refined_upwards_in_place_of_the_lowest_candidate(tmp_path: Path) -> None:
    """Full-batch GD diverged at 1.1x its stability limit and the retry cut its LR 4x: on a quadratic the highest
    stable LR descends fastest, so the cut beats a quarter of it, the probe stops descending there and tries the LR
    between the cut and the one that failed (0.55x the limit's LR: stable), which the loss then chooses."""
    plan = ProbePlan(candidates=(0.2264, 0.0566, 0.01415), steps=10, extend=(0.4528,))
    sink = ListSink()
    probed = run_attempt(AttemptSpec(recipe=build_recipe(LSQ), checkpoint_dir=str(tmp_path / "probed"), attempt=2,
                                     lr_probe=plan), sink)
    [event] = sink.of_type("lr_probe")
    tried = [(c["lr"], c["failed"], c["steps"]) for c in event["candidates"]]
    assert tried == [(0.2264, None, 10), (0.0566, None, 10), (0.4528, None, 10)]  # no 0.01415: the steps went up
    scores = [c["score"] for c in event["candidates"]]
    assert scores[2] < scores[0] < scores[1]  # found from the numbers: the loss fell fastest at the top
    assert event["chosen"] == 0.4528 and event["steps_run"] == 30
    plain = run_attempt(with_lr(AttemptSpec(recipe=build_recipe(LSQ), checkpoint_dir=str(tmp_path / "plain"),
                                            attempt=2), 0.4528))
    assert probed.losses == plain.losses and len(plain.losses) == 30


def test_the_score_is_the_mean_of_the_last_quarter() -> None:
    assert CandidateRun(1.0, (8, 8, 8, 8, 8, 8, 2, 4)).score == 3.0
    assert CandidateRun(1.0, (5, 7)).score == 7.0  # at least one loss
    assert CandidateRun(1.0, ()).score == math.inf


PROBE = ProbePlan(candidates=(0.25, 0.0625, 0.015625), steps=8)


def _spec(tmp_path: Path, name: str, **kw: Any) -> AttemptSpec:
    return AttemptSpec(recipe=build_recipe(EXPLODING_RNN), checkpoint_dir=str(tmp_path / name), **kw)


def test_a_probe_rejects_the_candidate_that_blows_up_and_leaves_no_trace(tmp_path: Path) -> None:
    sink = ListSink()
    probed = run_attempt(_spec(tmp_path, "probed", lr_probe=PROBE, attempt=2), sink)
    [event] = sink.of_type("lr_probe")
    assert sink.events[0]["type"] == "lr_probe"  # before the first step's metric
    first, *rest = event["candidates"]
    assert first["lr"] == 0.25 and first["failed"] and first["steps"] < PROBE.steps  # found from the numbers
    assert all(c["failed"] is None and c["steps"] == PROBE.steps for c in rest)
    assert event["chosen"] in (0.0625, 0.015625)
    assert event["steps_run"] == sum(c["steps"] for c in event["candidates"])
    assert event["start_step"] == 0 and f"chose {event['chosen']:.4g}" in event["reason"]
    assert probed.lr_probe == event and probed.end_event()["lr_probe"] == event

    # the attempt trained at the chosen LR exactly as an attempt started there without a probe does
    plain = run_attempt(with_lr(_spec(tmp_path, "plain", attempt=2), event["chosen"]))
    assert probed.losses == plain.losses and len(plain.losses) == 40
    assert sink.of_type("metric")[0]["lr"] == pytest.approx(event["chosen"])  # no warmup: the peak at step 0


def test_a_probe_from_a_checkpoint_starts_every_candidate_and_the_attempt_there(tmp_path: Path) -> None:
    safe = with_lr(_spec(tmp_path, "first"), 0.01)
    run_attempt(safe)
    ckpt = str(tmp_path / "first" / "step_00000020")
    resumed = replace(safe, checkpoint_dir=str(tmp_path / "probed"), attempt=2, resume_from=ckpt,
                      rewarm_steps=5)
    sink = ListSink()
    probed = run_attempt(replace(resumed, lr_probe=ProbePlan(candidates=(0.04, 0.01), steps=6)), sink)
    [event] = sink.of_type("lr_probe")
    assert event["start_step"] == 20 and [c["steps"] for c in event["candidates"]] == [6, 6]
    # the chosen candidate trained cleanly at the warmed-up LR from this very point: the re-warm is dropped
    assert all(c["failed"] is None for c in event["candidates"]) and event["rewarm_steps"] == 0
    assert "re-warm 5→0 steps" in event["reason"] and "if_clean" not in event
    unramped = lr_at(20, base_lr=event["chosen"], max_steps=40, schedule=resumed.recipe.schedule)
    assert sink.of_type("metric")[0]["lr"] == pytest.approx(unramped)  # the schedule's LR, not a 1/5 of it
    plain = replace(with_lr(resumed, event["chosen"]), checkpoint_dir=str(tmp_path / "plain"), rewarm_steps=0)
    assert probed.start_step == 20 and probed.losses == run_attempt(plain).losses and len(probed.losses) == 20


WARMUP = "schedule.warmup_steps"


def test_a_clean_pick_drops_the_warmup_the_retry_added(tmp_path: Path) -> None:
    """The retry of an early blow-up added a warmup and a re-warm; the probe's pick trained cleanly from
    initialisation at a constant LR, so the attempt trains as one at that LR with neither ramp."""
    spec = AttemptSpec(recipe=build_recipe(EXPLODING_RNN, schedule={"warmup_steps": 10}),
                       checkpoint_dir=str(tmp_path / "probed"), attempt=2, rewarm_steps=8,
                       lr_probe=replace(PROBE, if_clean={WARMUP: 0}))
    sink = ListSink()
    probed = run_attempt(spec, sink)
    [event] = sink.of_type("lr_probe")
    assert event["if_clean"] == {WARMUP: 0} and event["rewarm_steps"] == 0
    assert f"re-warm 8→0 steps, {WARMUP} 10→0" in event["reason"]
    assert sink.of_type("metric")[0]["lr"] == pytest.approx(event["chosen"])  # the peak at step 0
    plain = run_attempt(with_lr(_spec(tmp_path, "plain", attempt=2), event["chosen"]))
    assert probed.losses == plain.losses and len(plain.losses) == 40


def test_when_every_candidate_fails_the_ramps_stay(tmp_path: Path) -> None:
    """No clean pick, no evidence that the ramps are not needed: the lowest LR trains behind both."""
    spec = AttemptSpec(recipe=build_recipe(EXPLODING_RNN, schedule={"warmup_steps": 10}),
                       checkpoint_dir=str(tmp_path / "probed"), attempt=2, rewarm_steps=8,
                       lr_probe=ProbePlan(candidates=(4.0, 2.0), steps=8, if_clean={WARMUP: 0}))
    sink = ListSink()
    run_attempt(spec, sink)
    [event] = sink.of_type("lr_probe")
    assert all(c["failed"] for c in event["candidates"]) and event["chosen"] == 2.0
    assert "if_clean" not in event and "rewarm_steps" not in event and "→0" not in event["reason"]
    first = sink.of_type("metric")[0]
    assert first["lr"] == pytest.approx(2.0 / 10 / 8)  # the warmup's first step, re-warmed: both ramps kept


def test_a_replay_that_trains_cleanly_keeps_the_diverged_settings(tmp_path: Path) -> None:
    """The ended attempt's settings (lr 0.0625 behind a 10-step warmup) replayed from initialisation at their peak
    train cleanly: the probe stops there, and the attempt drops the retry's changes (the cut LR, the longer warmup,
    the re-warm) and trains exactly as an attempt with the original settings does."""
    original = build_recipe(EXPLODING_RNN, optimizer={"lr": 0.0625}, schedule={"warmup_steps": 10})
    retry = build_recipe(EXPLODING_RNN, optimizer={"lr": 0.015625}, schedule={"warmup_steps": 20})
    spec = AttemptSpec(recipe=retry, checkpoint_dir=str(tmp_path / "probed"), attempt=2, rewarm_steps=8,
                       lr_probe=ProbePlan(candidates=(0.0625, 0.015625), steps=8,
                                          replay={"optimizer.lr": 0.0625, WARMUP: 10}, replay_steps=13))
    sink = ListSink()
    probed = run_attempt(spec, sink)
    [event] = sink.of_type("lr_probe")
    # clean through its own 13 steps (past a candidate's 8, as a failed step further on needs): the probe ends there
    assert [(c["lr"], c["failed"], c["steps"]) for c in event["candidates"]] == [(0.0625, None, 13)]
    assert event["chosen"] == 0.0625 and event["steps_run"] == 13
    assert event["if_clean"] == {"optimizer.lr": 0.0625, WARMUP: 10} and event["rewarm_steps"] == 0
    assert f"kept (optimizer.lr 0.015625→0.0625, {WARMUP} 20→10)" in event["reason"]
    plain = run_attempt(AttemptSpec(recipe=original, checkpoint_dir=str(tmp_path / "plain"), attempt=2))
    assert probed.losses == plain.losses and len(plain.losses) == 40


def test_a_replay_that_diverges_again_is_rejected_and_the_retrys_changes_stay(tmp_path: Path) -> None:
    """lr 1.0 blows the RNN up within the probe's steps, as it did in the ended attempt: a cut LR is chosen and the
    retry's other change (its warmup) is not taken back."""
    retry = build_recipe(EXPLODING_RNN, optimizer={"lr": 0.25}, schedule={"warmup_steps": 10})
    spec = AttemptSpec(recipe=retry, checkpoint_dir=str(tmp_path / "probed"), attempt=2,
                       lr_probe=ProbePlan(candidates=(1.0, 0.25, 0.0625), steps=8,
                                          replay={"optimizer.lr": 1.0, WARMUP: 0}, replay_steps=8))
    sink = ListSink()
    run_attempt(spec, sink)
    [event] = sink.of_type("lr_probe")
    assert event["candidates"][0]["failed"] and event["chosen"] < 1.0
    assert "if_clean" not in event and "kept" not in event["reason"]
    assert sink.of_type("metric")[0]["lr"] == pytest.approx(event["chosen"] / 10)  # the retry's warmup stayed


def test_the_replay_trains_with_every_setting_of_the_ended_attempt_not_only_its_lr(tmp_path: Path) -> None:
    """The retry turned the clip on as well as cutting the LR; its replay reverts both. At lr 1.0 the RNN trains
    cleanly under a 0.1 clip but blows up without one, as the ended attempt did: a replay that kept the retry's clip
    would have passed it as a transient and taken the cut LR back."""
    retry = build_recipe(EXPLODING_RNN, optimizer={"lr": 0.25}, clipping={"method": "global_norm", "max_norm": 0.1})
    spec = AttemptSpec(recipe=retry, checkpoint_dir=str(tmp_path / "probed"), attempt=2,
                       lr_probe=ProbePlan(candidates=(1.0, 0.25, 0.0625), steps=8,
                                          replay={"optimizer.lr": 1.0, "clipping.method": "none"}, replay_steps=8))
    sink = ListSink()
    run_attempt(spec, sink)
    [event] = sink.of_type("lr_probe")
    assert event["candidates"][0]["lr"] == 1.0 and event["candidates"][0]["failed"]
    assert event["chosen"] < 1.0 and "kept" not in event["reason"]
    assert [c["failed"] for c in event["candidates"][1:]] == [None, None]  # the cut LRs, clipped, train cleanly


def test_a_stop_request_ends_the_probe_and_the_attempt(tmp_path: Path) -> None:
    """A cancel during the probe is not held up by the remaining candidates: the candidate that sees it stops,
    no other is tried, and the attempt ends cancelled at its first step."""
    sink = ListSink()
    sink.stop_requested = True
    result = run_attempt(_spec(tmp_path, "stopped", lr_probe=PROBE, attempt=2), sink)
    [event] = sink.of_type("lr_probe")
    assert [(c["lr"], c["failed"], c["steps"]) for c in event["candidates"]] == [(0.25, "stop requested", 1)]
    assert result.outcome == "cancelled" and result.final_step == 1
