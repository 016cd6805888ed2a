"""Table tests for the outcome verdict: reaching max_steps is not success."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from contracts.recipe import Action, Success
from contracts.wire import ANOMALY_KINDS
from workers.detectors import Finding
from workers.verdict import (
    COLLAPSED,
    DEGRADED,
    EVAL_DEGRADED,
    NEVER_LEARNED,
    OVERFITTING,
    STALLED,
    VANISHING,
    VERDICT_KINDS,
    EvalEvidence,
    Evidence,
    StallClock,
    Verdict,
    collapse_window,
    early_check_step,
    final_loss,
    final_stats,
    judge_collapse,
    judge_end,
    judge_eval,
    judge_progress,
    judge_stall,
    progress,
    progress_mark,
    stall_steps,
)

CFG = Success()


def ev(final: float | None, *, best: float | None = 1.6, best_step: int | None = 250, initial: float | None = 4.2,
       floor: float | None = 1.39, noise: float = 0.0, vanishing: bool = False, start: int = 0,
       since: int | None = None, trivial: float | None = None, stalled: tuple[int, int] = (0, 0),
       sem: float = 0.0) -> Evidence:
    return Evidence(final_loss=final, best_loss=best, best_step=best_step, initial_loss=initial, loss_floor=floor,
                    noise_std=noise, vanishing=vanishing, start_step=start, progress_step=since,
                    trivial_loss=trivial, stalled_for=stalled[0], stalled_from=stalled[1], final_sem=sem)


@pytest.mark.parametrize(
    ("evidence", "kind", "onset"),
    [
        (ev(1.65), None, None),                                   # learned, at its best: healthy
        (ev(4.0), NEVER_LEARNED, 0),                              # a plateau at chance after an early blow-up
        (ev(4.0, vanishing=True), VANISHING, 0),                  # vanishing and no progress: give up
        (ev(1.65, vanishing=True), None, None),                   # a recorded vanishing profile, but it learned
        (ev(2.4), DEGRADED, 251),                                  # 1.5x its own best: back to the best checkpoint
        (ev(1.9, noise=0.5), None, None),                          # noisy loss: within one batch-noise std
        (ev(2.0, best=None, best_step=None), None, None),         # no best known: only progress is judged
        (ev(None), DEGRADED, 0),                                   # nothing finite at the end
        (ev(0.5, best=0.48, initial=1.0, floor=None), None, None),  # unknown floor: progress towards 0
        (ev(0.9, best=0.85, initial=1.0, floor=None), NEVER_LEARNED, 0),  # 10% of the way to 0 < 25%
        (ev(2.4, start=100), DEGRADED, 251),
        # a blown-up initialisation (1.5e6 on unit-variance targets): a fall to 4e4 covers 97% of the way to the
        # floor but is no better than predicting the mean (1.0): it learned nothing
        (ev(4.1e4, best=4.0e4, initial=1.5e6, floor=1e-4, trivial=1.0), NEVER_LEARNED, 0),
        (ev(4.1e4, best=4.0e4, initial=1.5e6, floor=1e-4, trivial=1.0, vanishing=True, start=30), VANISHING, 30),
        (ev(1.0, best=1.0, initial=1.5e6, floor=1e-4, trivial=1.0), NEVER_LEARNED, 0),  # exactly the mean's loss
        (ev(0.9, best=0.9, initial=1.5e6, floor=1e-4, trivial=1.0), None, None),  # below it: it learned something
        (ev(1.65, trivial=3.18), None, None),  # a language model well below its token frequencies' entropy
        # a user's data: no floor, the way measured toward what ignoring the inputs scores (measured on the targets)
        (ev(0.6, best=0.59, initial=0.7, floor=None, trivial=0.69), None, None),  # a hard task, 14% of the way to 0
        (ev(0.69, best=0.68, initial=0.7, floor=None, trivial=0.69), NEVER_LEARNED, 0),  # the frequencies' entropy
        (ev(0.67, best=0.67, initial=0.68, floor=None, trivial=0.69), None, None),  # started below it: it beat it
        (ev(30.0, best=29.0, initial=100.0, floor=None, trivial=1.0), NEVER_LEARNED, 0),  # targets' mean far from 0
        (ev(80.0, best=79.0, initial=100.0, floor=None, trivial=1.0), NEVER_LEARNED, 0),  # 20% of the way to 1
        # below it by less than the noise (2 standard errors of the final loss, 0.0224 each): a model at the
        # frequencies' entropy ends below it half the time by chance; beyond the noise it learned something
        (ev(0.40, best=0.40, initial=0.7, floor=None, trivial=0.41, sem=0.0224), NEVER_LEARNED, 0),
        (ev(0.3653, best=0.36, initial=0.7, floor=None, trivial=0.41, sem=0.0224), NEVER_LEARNED, 0),
        (ev(0.3647, best=0.36, initial=0.7, floor=None, trivial=0.41, sem=0.0224), None, None),
        (ev(0.40, best=0.40, initial=0.7, floor=None, trivial=0.41), None, None),  # no noise measured: below it
        # the loss detector's batch noise (inflated by a blown-up start) is not the final loss's: it learned
        (ev(0.05, best=0.05, initial=40.0, floor=None, trivial=1.0, noise=10.0, sem=0.002), None, None),
    ],
)
def test_judge_end(evidence: Evidence, kind: str | None, onset: int | None) -> None:
    v = judge_end(CFG, evidence)
    assert v.kind == kind, v.reason
    assert v.healthy is (kind is None)
    if kind is not None:
        assert v.onset_step == onset
        assert v.value == evidence.final_loss


def test_reasons_name_the_numbers() -> None:
    v = judge_end(CFG, ev(2.4))
    assert "2.4" in v.reason and "1.6" in v.reason and "step 250" in v.reason
    v = judge_end(CFG, ev(4.0, vanishing=True))
    assert "vanishing" in v.reason and "4" in v.reason


def test_a_loss_no_better_than_ignoring_the_inputs_names_both_numbers() -> None:
    v = judge_end(CFG, ev(4.1e4, best=4.0e4, initial=1.5e6, floor=1e-4, trivial=1.0))
    assert "4.1e+04" in v.reason and "no better than 1," in v.reason and "1.5e+06" in v.reason
    assert v.threshold == 1.0
    v = judge_end(CFG, ev(4.1e4, best=4.0e4, initial=1.5e6, floor=1e-4, trivial=1.0, vanishing=True))
    assert v.reason.startswith("vanishing gradients: the final loss 4.1e+04 is no better than 1,")
    assert "cannot fix vanishing gradients" in v.reason and v.threshold == 1.0


def test_a_loss_below_ignoring_the_inputs_by_less_than_the_noise_says_so() -> None:
    v = judge_end(CFG, ev(0.40, best=0.40, initial=0.7, floor=None, trivial=0.41, sem=0.0224))
    assert "the final loss 0.4 is no better than 0.41," in v.reason, v.reason
    assert "within the noise: 2 standard errors of the final loss, 0.0448" in v.reason, v.reason
    assert "within the noise" not in judge_end(CFG, ev(0.42, best=0.40, initial=0.7, floor=None, trivial=0.41,
                                                       sem=0.0224)).reason


def test_the_final_losss_standard_error_is_over_the_same_losses_as_the_final_loss() -> None:
    losses = [9.0, float("nan"), 1.0, 3.0, 100.0, 5.0]  # step 104 skipped; NaN left out
    assert final_loss(losses, 3, start_step=100, skipped=[104]) == pytest.approx(3.0)
    final, sem = final_stats(losses, 3, start_step=100, skipped=[104])
    assert final == pytest.approx(3.0) and sem == pytest.approx(2.0 / math.sqrt(3))
    assert final_stats([1.0], 20) == (1.0, 0.0) and final_stats([], 20) == (None, 0.0)


def test_the_reason_names_the_way_it_measured() -> None:
    """The floor when known; else, on a user's data, what ignoring the inputs scores; else 0 ("its floor")."""
    assert "to the floor 1.39 (needs 25%)" in judge_end(CFG, ev(4.0)).reason
    v = judge_end(CFG, ev(80.0, best=79.0, initial=100.0, floor=None, trivial=1.0))
    assert "covered 20% of the way from the initial 100 to what ignoring the inputs scores, 1 (needs 25%)" in v.reason
    assert v.threshold == pytest.approx(100.0 - 0.25 * 99.0)
    assert "to its floor (needs 25%)" in judge_end(CFG, ev(0.9, best=0.85, initial=1.0, floor=None)).reason


def test_users_own_bar() -> None:
    cfg = Success(max_final_loss=1.5)
    assert judge_end(cfg, ev(1.65)).kind == "above_bar"
    assert judge_end(cfg, ev(1.45, best=1.44)).healthy


def test_progress_and_early_check() -> None:
    assert progress(2.8, 4.2, 1.4) == pytest.approx(0.5)
    assert progress(1.0, None, 0.0) is None
    assert progress(0.25, 0.5, 1.0) == pytest.approx(0.5)  # a floor above the initial loss: measure toward 0
    assert early_check_step(CFG, max_steps=300, warmup_steps=0) == 75
    assert early_check_step(CFG, max_steps=300, warmup_steps=40) == 120
    assert early_check_step(CFG, max_steps=10, warmup_steps=9) == 9
    stuck = judge_progress(CFG, smoothed_loss=4.15, ev=ev(None), step=75)
    assert stuck.kind == NEVER_LEARNED and "step 75" in stuck.reason and stuck.onset_step == 0
    assert judge_progress(CFG, smoothed_loss=3.5, ev=ev(None), step=75).healthy


def test_the_early_check_gives_the_vanishing_diagnosis_when_the_gradients_vanished() -> None:
    """Stopped early, a run whose gradients vanished gets the same diagnosis as at the end (so the policy gives up
    instead of spending a retry that cannot help); one that learned is not judged on it."""
    stuck = judge_progress(CFG, smoothed_loss=4.15, ev=ev(None, vanishing=True, start=40), step=75)
    assert stuck.kind == VANISHING and "vanishing gradients" in stuck.reason and "by step 75" in stuck.reason
    assert stuck.onset_step == 40
    assert judge_progress(CFG, smoothed_loss=3.5, ev=ev(None, vanishing=True), step=75).healthy


# ------------------------------------------------------------------------------------------------ the stall rule
@pytest.mark.parametrize(
    ("evidence", "step", "kind"),
    [
        # initial 4.2, floor 1.39: 75% of the way is 2.09
        (ev(None, best=2.8, best_step=30), 70, STALLED),          # 50% of the way, no new best for 40 steps
        (ev(None, best=2.8, best_step=30), 69, None),             # 39 steps: not yet
        (ev(None, best=2.8, best_step=31), 70, None),             # a newer best restarts the wait
        (ev(None, best=2.0, best_step=30), 200, None),            # 78% of the way: a run may level off there
        (ev(None, best=2.8, best_step=30, floor=None), 200, None),  # no known floor: the rule cannot judge
        (ev(None, best=None, best_step=None), 200, None),          # nothing smoothed yet
        (ev(None, best=2.8, best_step=30, start=50), 89, None),    # resumed at 50: its own 40 steps from there
        (ev(None, best=2.8, best_step=30, start=50), 90, STALLED),  # and then the stall began before it: onset 0
        (ev(None, best=2.8, best_step=60, start=50), 100, STALLED),  # began in this attempt: onset at its start
        (ev(None, best=4.3, best_step=30), 70, STALLED),           # never below the initial loss at all
        (ev(None, best=2.8, best_step=60, since=30), 70, STALLED),  # newer bests, but none by 1% of the way
        (ev(None, best=2.8, best_step=60, since=31), 70, None),     # the last that counted: 39 steps ago
        (ev(None, best=2.8, best_step=30, vanishing=True), 70, VANISHING),  # why it stalled: give up, not retry
    ],
)
def test_judge_stall(evidence: Evidence, step: int, kind: str | None) -> None:
    v = judge_stall(CFG, evidence, step=step, patience=40)
    assert v.kind == kind, v.reason
    if kind is STALLED:
        assert evidence.best_step is not None
        # like never learned: the whole attempt (or the lineage, when the stall began before it) ran at that LR
        assert v.onset_step == (evidence.start_step if evidence.best_step >= evidence.start_step else 0)
        assert v.value == evidence.best_loss
        assert v.threshold == pytest.approx(4.2 - 0.75 * (4.2 - 1.39))


@pytest.mark.parametrize(
    ("mark", "best_step", "best", "initial", "floor", "min_gain", "expected"),
    [
        # initial 4.2, floor 1.39: 1% of the way is 0.0281
        (None, 5, 3.0, 4.2, 1.39, 0.01, (5, 3.0)),               # the first best sets the mark
        ((5, 3.0), 9, 2.98, 4.2, 1.39, 0.01, (5, 3.0)),          # 0.02 lower: less than 1% of the way, no move
        ((5, 3.0), 9, 2.97, 4.2, 1.39, 0.01, (9, 2.97)),         # 0.03 lower: it counts
        ((5, 3.0), 9, 2.98, 4.2, 1.39, 0.0, (9, 2.98)),          # 0: any new best counts, as before
        ((5, 3.0), 9, 2.98, 4.2, None, 0.01, (9, 2.98)),         # no floor: the way is unknown, any best counts
        ((5, 3.0), 5, 3.0, 4.2, 1.39, 0.01, (5, 3.0)),           # no new best
        ((5, 3.0), None, None, 4.2, 1.39, 0.01, (5, 3.0)),       # nothing smoothed (a disabled detector)
        (None, None, None, 4.2, 1.39, 0.01, None),
    ],
)
def test_progress_mark(mark: tuple[int, float] | None, best_step: int | None, best: float | None, initial: float,
                       floor: float | None, min_gain: float, expected: tuple[int, float] | None) -> None:
    assert progress_mark(mark, best_step=best_step, best_loss=best, initial=initial, floor=floor,
                         min_gain=min_gain) == expected


def test_a_creeping_plateau_stalls_though_it_keeps_setting_new_bests() -> None:
    """A loss that creeps down a hair at a time (0.02% of the way to the floor a step, plus seeded batch noise)
    sets a new smoothed best every few steps: a clock that any new best restarts never runs out in 300 steps, while
    the improvements that count (1% of the way) are more than the 40-step patience apart, so the rule fires, and
    says since when."""
    import random

    rng = random.Random(11)
    initial, floor, ema, alpha = 4.2, 1.39, 2.8, 0.05
    best: tuple[int, float] | None = None
    mark: tuple[int, float] | None = None
    first: dict[str, Verdict] = {}
    for step in range(1, 301):
        ema += alpha * (2.8 - 2e-4 * (initial - floor) * step + rng.gauss(0.0, 0.02) - ema)
        if best is None or ema < best[1]:
            best = (step, ema)
        mark = progress_mark(mark, best_step=best[0], best_loss=best[1], initial=initial, floor=floor,
                             min_gain=CFG.stall_min_gain)
        assert mark is not None
        for name, since in (("any best", best[0]), ("gain", mark[0])):
            v = judge_stall(CFG, ev(None, best=best[1], best_step=best[0], since=since), step=step, patience=40)
            if not v.healthy:
                first.setdefault(name, v)
    assert "any best" not in first
    v = first["gain"]
    assert v.kind == STALLED and "less than 1% of the way to the floor for 40 steps" in v.reason, v.reason


def test_at_the_end_the_stall_rule_judges_the_whole_lineage() -> None:
    """An attempt resumed close to the end (the baseline's restart from the newest checkpoint, a crash restart)
    has no whole window left: while it runs it is not judged, but its end is, on the lineage's best."""
    late = ev(2.7, best=2.6, best_step=30, start=150)
    assert judge_stall(CFG, late, step=180, patience=40).healthy
    end = judge_end(CFG, late, step=180, stall_patience=40)
    assert end.kind == STALLED and end.onset_step == 0
    assert judge_end(CFG, late).healthy  # without the stall arguments: the other rules alone (2.7 is 36% of the way)
    improving = ev(2.7, best=2.6, best_step=170, start=150)  # as far from the floor, but the retry improved on it
    assert judge_end(CFG, improving, step=180, stall_patience=40).healthy


@pytest.mark.parametrize(
    ("evidence", "kind", "onset"),
    [
        # resumed at 150; the best (step 170) improved on the lineage's, but the lineage once stood still
        (ev(2.7, best=2.6, best_step=170, start=150, since=170, stalled=(85, 40)), STALLED, 0),
        (ev(2.7, best=2.6, best_step=170, start=150, since=170, stalled=(39, 40)), None, None),  # never a window
        (ev(2.7, best=2.6, best_step=170, start=30, since=170, stalled=(60, 40)), STALLED, 30),  # stood still here
        (ev(1.7, best=1.6, best_step=170, start=150, since=170, stalled=(85, 40)), None, None),  # past the bar now
    ],
)
def test_at_the_end_a_lineage_that_once_stood_still_for_a_window_must_be_past_the_bar(
        evidence: Evidence, kind: str | None, onset: int | None) -> None:
    """The grace a resumed attempt gets while it runs does not extend to the end: a lineage that stood still for
    a whole window far from its floor is not made healthy by creeping lower in the steps after a resume."""
    assert judge_stall(CFG, evidence, step=180, patience=40).healthy  # while it runs: the resume's grace
    end = judge_end(CFG, evidence, step=180, stall_patience=40)
    assert (end.kind, end.onset_step) == (kind, onset), end.reason
    if kind is not None:
        assert f"for {evidence.stalled_for} steps (from step {evidence.stalled_from})" in end.reason, end.reason
        assert "2.6 (step 170)" in end.reason and "75%" in end.reason


def _lineage(plateau: range, step_loss: float) -> list[float]:
    """A best smoothed loss by step: falls 4.2 -> 2.8 over 20 steps, flat over ``plateau``, then creeps down by
    ``step_loss`` a step."""
    best, out = 4.2, []
    for step in range(181):
        if step <= 20:
            best = 4.2 - 1.4 * step / 20
        elif step > plateau.stop:
            best -= step_loss
        out.append(best)
    return out


def test_the_stall_clock_survives_a_resume_and_times_the_longest_stretch() -> None:
    """The baseline's restarts (resume from the newest checkpoint, same settings) of a lineage that stood still
    from step 20 to 120 and then crept 1.5% of the way to the floor every 10 steps: each resume restores the clock
    from its checkpoint, so it remembers that stretch; a clock started afresh at the resume would not."""
    initial, floor = 4.2, 1.39
    losses = _lineage(range(20, 120), 0.015 * (initial - floor) / 10)

    def run(clock: StallClock, steps: range) -> StallClock:
        for step in steps:
            best_step = max(i for i in range(step + 1) if losses[i] == min(losses[: step + 1]))
            clock.tick(step, best_step=best_step, best_loss=losses[best_step], initial=initial, floor=floor,
                       min_gain=CFG.stall_min_gain, max_progress=CFG.stall_max_progress)
        return clock

    saved = run(StallClock(), range(0, 126)).state_dict()  # the checkpoint at step 125
    restored = StallClock()
    restored.load_state_dict(saved)
    resumed = run(restored, range(126, 181))
    assert (resumed.longest, resumed.longest_from) == (106, 20)  # until the creep had covered 1%, at step 127
    assert resumed.mark is not None and resumed.mark[0] > 160  # it did improve by 1% of the way lately
    assert run(StallClock(), range(0, 181)).state_dict() == resumed.state_dict()  # as if never interrupted
    assert run(StallClock(), range(126, 181)).longest < 40  # afresh, the resume would have forgotten
    near = StallClock()  # the same flat stretch, but past the bar (a run levelling off near its floor)
    for step in range(100):
        near.tick(step, best_step=10, best_loss=1.5, initial=initial, floor=floor, min_gain=CFG.stall_min_gain,
                  max_progress=CFG.stall_max_progress)
    assert near.longest == 0


def test_the_stall_reason_names_the_numbers() -> None:
    v = judge_stall(CFG, ev(None, best=2.8, best_step=30), step=75, patience=40)
    assert "stalled" in v.reason and "2.8" in v.reason and "step 30" in v.reason and "45 steps" in v.reason
    assert "50%" in v.reason and "1.39" in v.reason and "75%" in v.reason


@pytest.mark.parametrize(
    ("fraction", "max_steps", "alpha", "expected"),
    [
        (0.2, 180, 0.05, 40),        # two EMA horizons (2/0.05) outlast a fifth of a short run
        (0.2, 1000, 0.05, 200),      # a fifth of a long one
        (0.2, 1000, 0.01, 200),      # a slower EMA: 200 either way
        (0.05, 10_000, 0.005, 500),  # 2/0.005 = 400 < 500
        (None, 1000, 0.05, None),    # off
    ],
)
def test_stall_steps(fraction: float | None, max_steps: int, alpha: float, expected: int | None) -> None:
    assert stall_steps(Success(stall_fraction=fraction), max_steps=max_steps, ema_alpha=alpha) == expected


def test_the_stall_bar_is_the_recipes() -> None:
    strict = Success(stall_max_progress=0.9)
    assert judge_stall(strict, ev(None, best=2.0, best_step=30), step=200, patience=40).kind == STALLED
    assert judge_stall(CFG, ev(None, best=2.0, best_step=30), step=200, patience=40).healthy


# ---------------------------------------------------------------------------------------------- collapse
def collapse(norm: float, loss: float, *, step: int = 40, max_steps: int = 300, baseline: float | None = 1.7,
             floor: float | None = 1.25, cfg: Success = CFG) -> Verdict:
    """The rule over a window of 20 steps whose every norm is ``norm`` and every loss ``loss``; the initial loss
    is 3.45, so the way to the floor is 2.2 (30% of it: down to 2.79)."""
    return judge_collapse(cfg, step=step, max_steps=max_steps, baseline_norm=baseline, norms=[norm] * 20,
                          losses=[loss] * 20, initial_loss=3.45, loss_floor=floor)


@pytest.mark.parametrize(
    ("norm", "loss", "kwargs", "kind"),
    [
        (0.34, 3.35, {}, COLLAPSED),                  # 0.2x the first steps' norm, 5% of the way: flat, far off
        (0.67, 3.35, {}, COLLAPSED),                  # 0.39x: just under the bar
        (0.69, 3.35, {}, None),                        # 0.41x: gradients at their scale
        (0.34, 2.75, {}, None),                        # 32% of the way: gradients shrank with the loss
        (0.34, 2.85, {}, COLLAPSED),                   # 27%
        (0.34, 3.35, {"step": 151}, None),             # past half the run: the stall rule's ground
        (0.34, 3.35, {"step": 150}, COLLAPSED),        # half the run is still inside
        (0.34, 3.35, {"floor": None}, None),           # no known floor, no rule (as for a stall)
        (0.34, 3.35, {"baseline": None}, None),        # no finite norm in the first steps
        (0.34, 3.35, {"cfg": Success(collapse_ratio=None)}, None),                # off
        (0.69, 3.35, {"cfg": Success(collapse_ratio=0.5)}, COLLAPSED),           # the recipe's bar
        (0.34, 2.75, {"cfg": Success(collapse_max_progress=0.35)}, COLLAPSED),    # ... and its progress bar
    ],
)
def test_judge_collapse(norm: float, loss: float, kwargs: dict[str, Any], kind: str | None) -> None:
    v = collapse(norm, loss, **kwargs)
    assert v.kind == kind, v.reason
    if kind is not None:
        assert v.onset_step == 0  # like a stall: every step so far ran at the LR that did it


def test_the_collapse_rule_reads_medians_so_one_outlier_moves_neither_number() -> None:
    norms, losses = [0.3] * 20, [3.35] * 20
    norms[7], losses[7] = 50.0, 1.3  # one huge norm, one low loss: the medians do not move
    v = judge_collapse(CFG, step=40, max_steps=300, baseline_norm=1.7, norms=norms, losses=losses,
                       initial_loss=3.45, loss_floor=1.25)
    assert v.kind == COLLAPSED
    losses[:11] = [2.5] * 11  # most of the window well on its way: the loss is making progress
    assert judge_collapse(CFG, step=40, max_steps=300, baseline_norm=1.7, norms=norms, losses=losses,
                          initial_loss=3.45, loss_floor=1.25).healthy


def test_the_collapse_reason_names_the_numbers() -> None:
    v = collapse(0.34, 3.35)
    assert v.reason.startswith("collapsed: by step 40 the median gradient norm 0.34 of the last 20 steps is 0.20x")
    assert "first steps' 1.7" in v.reason and "3.35" in v.reason and "4.5% of the way" in v.reason
    assert "initial 3.45" in v.reason and "floor 1.25" in v.reason and (v.value, v.threshold) == (0.2, 0.4)


def test_the_collapse_window_is_the_loss_emas_horizon() -> None:
    assert (collapse_window(0.05), collapse_window(0.1), collapse_window(0.03)) == (20, 10, 34)


def test_final_loss_is_the_mean_of_the_last_finite_losses() -> None:
    assert final_loss([5.0, 1.0, float("nan"), 3.0], 2) == pytest.approx(2.0)
    assert final_loss([float("inf")], 5) is None


def test_final_loss_leaves_out_the_steps_whose_update_was_skipped() -> None:
    """A skipped step's loss is its (abnormal) batch's, not the model's: a poisoned batch among the last steps does
    not make the end look degraded. ``losses[i]`` is step ``start_step + i``."""
    tail = [0.04, 0.05, 1.56, 0.04, 0.05]  # step 102: a poisoned batch whose update was thrown away
    assert final_loss(tail, 3, start_step=100) == pytest.approx((1.56 + 0.04 + 0.05) / 3)
    assert final_loss(tail, 3, start_step=100, skipped=[102]) == pytest.approx((0.05 + 0.04 + 0.05) / 3)
    assert final_loss([1.0, 2.0], 2, start_step=7, skipped=[7, 8]) is None


def test_zero_turns_the_progress_rules_off() -> None:
    off = Success(min_progress=0.0, early_min_progress=0.0)
    assert judge_end(off, ev(4.7, best=4.2)).kind == DEGRADED  # regression is still judged
    assert judge_end(off, ev(4.3, best=4.2)).healthy
    assert judge_progress(off, smoothed_loss=4.5, ev=ev(None), step=75).healthy
    # and the trivial-loss test with them (a short run to check mechanics, not learning)
    assert judge_end(off, ev(5.3, best=5.2, initial=16.1, trivial=3.98)).healthy
    assert judge_end(CFG, ev(5.3, best=5.2, initial=16.1, trivial=3.98)).kind == NEVER_LEARNED


def test_every_verdict_kind_is_a_known_anomaly_kind() -> None:
    """The verdict is recorded as an anomaly; the API's ``?kind=`` filter accepts only contracts' kinds."""
    assert set(VERDICT_KINDS) <= set(ANOMALY_KINDS)


def test_a_finding_of_an_unknown_kind_is_refused_when_made() -> None:
    with pytest.raises(ValueError, match="ANOMALY_KINDS"):
        Finding(step=1, kind="made_up", detector="x", value=1.0, threshold=0.5, action=Action.rollback)
    assert Finding(step=1, kind="loss_spike", detector="loss", value=1.0, threshold=0.5,
                   action=Action.rollback).kind == "loss_spike"


# ------------------------------------------------------------------------------------ the held-out (eval) rules
def held_out(final: float, *, best: float | None = 1.7, best_step: int | None = 200, initial: float | None = 4.1,
             final_step: int = 300, train_at_best: float | None = None) -> EvalEvidence:
    return EvalEvidence(initial=initial, best=best, best_step=best_step, final=final, final_step=final_step,
                        train_at_best=train_at_best)


@pytest.mark.parametrize(
    ("evals", "kind", "onset"),
    [
        (None, None, None),                                        # no eval series: the verdict is unchanged
        (held_out(1.75), None, None),                              # near its best: healthy
        (held_out(1.87), None, None),                              # 1.1x the best: at the limit, allowed
        (held_out(2.2), EVAL_DEGRADED, 200),                       # regressed: back to the best eval's step
        (held_out(float("nan")), EVAL_DEGRADED, 200),              # not finite
        (held_out(float("inf"), best=None, best_step=None), EVAL_DEGRADED, 100),  # never finite: the start
        (held_out(4.1, best=4.0, best_step=20), NEVER_LEARNED, 100),  # no better than before any update
        (held_out(4.2, best=None, best_step=None), NEVER_LEARNED, 100),  # nothing finite but the end: no best
        (held_out(4.1, best=4.0, initial=None), None, None),       # no initial eval (resumed lineage): not judged
        (held_out(2.2, best=-1.0), None, None),                    # a loss <= 0 has no ratio to regress by
    ],
)
def test_judge_end_with_an_eval_series(evals: EvalEvidence | None, kind: str | None, onset: int | None) -> None:
    """The training loss is healthy in every row (1.65 vs best 1.6): only the held-out numbers decide."""
    evidence = dataclasses.replace(ev(1.65, start=100), eval=evals)
    v = judge_end(CFG, evidence)
    assert v.kind == kind, v.reason
    if kind is not None:
        assert v.onset_step == onset
        assert "eval loss" in v.reason


@pytest.mark.parametrize(
    ("evals", "kind"),
    [
        (held_out(2.2, train_at_best=1.9), OVERFITTING),               # the training loss fell 13% meanwhile
        (held_out(2.2, train_at_best=1.8), EVAL_DEGRADED),             # fell 8%: under the 10% tolerance
        (held_out(2.2, train_at_best=None), EVAL_DEGRADED),            # unknown there (an earlier attempt)
        (held_out(float("nan"), train_at_best=4.2), EVAL_DEGRADED),     # not finite: a numeric problem
        (held_out(4.3, best=4.1, best_step=0, train_at_best=4.2), OVERFITTING),  # never better than untrained
        (held_out(1.75, train_at_best=4.2), None),                     # healthy is healthy
    ],
)
def test_a_held_out_loss_that_rose_while_the_training_loss_fell_is_overfitting(
    evals: EvalEvidence, kind: str | None,
) -> None:
    """The training loss at the end (1.65) against where it was when the eval loss was at its best: fallen by more
    than the eval tolerance, the held-out regression is overfitting, which the recovery policy does not retry."""
    v = judge_end(CFG, dataclasses.replace(ev(1.65, start=100), eval=evals))
    assert v.kind == kind, v.reason
    if kind == OVERFITTING:
        assert "training loss fell from" in v.reason and "1.65" in v.reason and "stop earlier" in v.reason
        assert v.onset_step == judge_eval(evals, tolerance=0.1, start_step=100).onset_step


def test_training_rules_come_first_and_the_bar_after() -> None:
    regressed = held_out(2.2)
    assert judge_end(CFG, dataclasses.replace(ev(2.4), eval=regressed)).kind == DEGRADED
    assert judge_end(CFG, dataclasses.replace(ev(4.0), eval=regressed)).kind == NEVER_LEARNED
    bar = Success(max_final_loss=1.5)
    assert judge_end(bar, dataclasses.replace(ev(1.65), eval=regressed)).kind == EVAL_DEGRADED
    assert judge_end(bar, dataclasses.replace(ev(1.65), eval=held_out(1.75))).kind == "above_bar"


def test_eval_tolerance_is_configurable_and_none_turns_the_rules_off() -> None:
    evidence = dataclasses.replace(ev(1.65), eval=held_out(2.2))
    assert judge_end(Success(eval_regression_tolerance=0.5), evidence).healthy
    assert judge_end(Success(eval_regression_tolerance=0.2), evidence).kind == EVAL_DEGRADED
    assert judge_end(Success(eval_regression_tolerance=None), evidence).healthy
    assert judge_end(Success(eval_regression_tolerance=None),
                     dataclasses.replace(ev(1.65), eval=held_out(float("nan")))).healthy
    v = judge_end(CFG, evidence)
    assert (v.value, v.threshold) == (2.2, pytest.approx(1.87))
    assert "2.2" in v.reason and "1.7" in v.reason and "step 200" in v.reason
    assert "eval loss 1.75" in judge_end(CFG, dataclasses.replace(ev(1.65), eval=held_out(1.75))).reason
