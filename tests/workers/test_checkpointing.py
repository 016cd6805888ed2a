"""What a trainer's checkpoint is labelled with, and where a resume finds it (the loop's own checkpoints are tested
end to end in test_engine.py)."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from workers.checkpointing import health_verdict, materialize


def test_health_verdict_needs_finite_weights_loss_in_bounds_and_no_anomaly() -> None:
    model = nn.Linear(3, 2)
    healthy, verdict = health_verdict(model, loss=0.5, loss_in_bounds=True, anomalies=0)
    assert healthy and verdict == {"weights_finite": True, "anomalies_since_previous": 0, "loss_in_bounds": True,
                                   "loss": 0.5}
    assert not health_verdict(model, loss=0.5, loss_in_bounds=True, anomalies=1)[0]
    assert not health_verdict(model, loss=0.5, loss_in_bounds=False, anomalies=0)[0]
    with torch.no_grad():
        model.bias[0] = math.inf
    healthy, verdict = health_verdict(model, loss=math.nan, loss_in_bounds=True, anomalies=0)
    assert not healthy and verdict["weights_finite"] is False and verdict["loss"] is None


def test_materialize_local_paths_and_file_uris(tmp_path: Path) -> None:
    with materialize(None) as none:
        assert none is None
    with materialize(str(tmp_path)) as plain:
        assert plain == str(tmp_path)
    with materialize(f"file://{tmp_path}") as local:
        assert local == str(tmp_path)
