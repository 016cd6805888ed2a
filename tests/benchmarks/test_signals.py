"""``benchmarks/divergence/signals.py``: the numbers a run-time rule could read, and the warmup-end LR check.

``stats`` on hand-made curves whose answers are known in closed form; ``lr_check`` on a real least-squares run at
a stable LR (seconds on CPU), where a quarter of the LR descends more slowly over the probe's steps.
"""

from __future__ import annotations

import pytest

from benchmarks.divergence.fresh import SETS
from benchmarks.divergence.signals import lr_check, stats


def _curves(losses: list[float], floor: float, norms: list[float] | None = None) -> dict[str, object]:
    return {"outcome": "succeeded", "loss": losses, "floor": floor, "gn": norms or [1.0] * len(losses), "ur": []}


def test_a_loss_that_never_moves_is_flat_for_the_whole_run_and_covers_none_of_the_way() -> None:
    s = stats(_curves([3.0] * 100, floor=1.0))
    assert s["end"] == pytest.approx(0.0)
    assert s["flat"] == 95  # the best is kept from the fifth loss on (step 4), and never improves after it
    assert s["giveback"] == 0.0


def test_the_share_of_the_way_is_the_final_mean_between_the_first_loss_and_the_floor() -> None:
    losses = [3.0 - 2.0 * i / 50 for i in range(50)] + [1.0] * 50  # to 1.0, then level: 2 of the 2.5 to the floor
    s = stats(_curves(losses, floor=0.5))
    assert s["end"] == pytest.approx(0.8)
    assert s["giveback"] == pytest.approx(0.0, abs=1e-12)  # the smoothed loss never rose above its best


def test_a_rise_after_learning_is_read_as_a_share_of_the_progress_given_back() -> None:
    # from 3 to 1, then back to 2: half of the progress given back, once the smoothed loss has caught up
    losses = [3.0] + [1.0] * 80 + [2.0] * 80
    s = stats(_curves(losses, floor=0.0))
    assert 0.45 < s["giveback"] <= 0.5


def test_the_gradient_norm_fall_is_the_lowest_20_step_median_over_the_first_five() -> None:
    norms = [2.0] * 5 + [1.0] * 30 + [0.5] * 30 + [1.0] * 35
    s = stats(_curves([3.0 - i / 100 for i in range(100)], floor=0.0, norms=norms))
    assert s["gn"] == pytest.approx(0.25)


def test_at_its_stable_lr_a_least_squares_run_probes_worse_at_a_quarter_of_it() -> None:
    doc, _ = SETS["2026-12-07"]["control-gd-lsq-half-limit"]
    r = lr_check(doc, doc["optimizer"]["lr"])
    assert r["outcome"] == "succeeded" and r["at"] == 20
    assert r["lower_gain"] is not None and r["lower_gain"] < 0
    assert r["scores"][0] < r["scores"][1]
