"""What a trainer's checkpoint is labelled with, and where a resume finds it (the loop's own checkpoints are tested
end to end in test_engine.py)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from workers.checkpointing import health_verdict, materialize
from workers.detectors import LossSummary

CALM = LossSummary(smoothed=1.7, best=1.6, best_step=90, initial=4.2, noise_std=0.05)


def verdict_of(model: nn.Module, *, loss: float = 0.5, in_bounds: bool = True, anomalies: int = 0,
               summary: LossSummary = CALM) -> tuple[bool, dict[str, object]]:
    return health_verdict(model, loss=loss, loss_in_bounds=in_bounds, anomalies=anomalies, summary=summary,
                          regression_tolerance=0.1)


def test_health_verdict_needs_finite_weights_loss_in_bounds_and_no_regression() -> None:
    model = nn.Linear(3, 2)
    healthy, verdict = verdict_of(model)
    assert healthy and verdict == {"weights_finite": True, "anomalies_since_previous": 0, "loss_in_bounds": True,
                                   "loss": 0.5, "smoothed_loss": 1.7, "best_smoothed_loss": 1.6, "regressed": False}
    assert not verdict_of(model, in_bounds=False)[0]
    # issue 9 case 7: 1.7x the best was labelled healthy because only the 2x divergence rule looked
    regressed = LossSummary(smoothed=1.6 * 1.7, best=1.6, best_step=90, initial=4.2, noise_std=0.05)
    healthy, verdict = verdict_of(model, summary=regressed)
    assert not healthy and verdict["regressed"] is True
    # within the tolerance plus one batch-noise deviation: still healthy
    assert verdict_of(model, summary=LossSummary(1.6 * 1.1 + 0.04, 1.6, 90, 4.2, 0.05))[0]
    with torch.no_grad():
        model.bias[0] = math.inf
    healthy, verdict = verdict_of(model, loss=math.nan)
    assert not healthy and verdict["weights_finite"] is False and verdict["loss"] is None


def test_handled_anomalies_leave_health_alone() -> None:
    """A skipped step (its update discarded) or a record-only finding does not taint the state; an unresolved
    anomaly ends the attempt before any checkpoint, so it never reaches this verdict."""
    healthy, verdict = verdict_of(nn.Linear(3, 2), anomalies=3)
    assert healthy and verdict["anomalies_since_previous"] == 3


def test_nothing_known_yet_is_not_a_regression() -> None:
    assert verdict_of(nn.Linear(3, 2), summary=LossSummary(None, None, None, None, 0.0))[0]


def test_materialize_local_paths_and_file_uris(tmp_path: Path) -> None:
    with materialize(None) as none:
        assert none is None
    with materialize(str(tmp_path)) as plain:
        assert plain == str(tmp_path)
    with materialize(f"file://{tmp_path}") as local:
        assert local == str(tmp_path)
