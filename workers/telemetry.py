"""The per-step event payloads the trainer emits (``metric`` every step, ``layer_stats`` every k steps).

Payload fields are listed in ``contracts/wire.py``; statistics that are not finite travel as None (JSON has no NaN).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from contracts.wire import finite_or_none
from workers.clipping import per_layer_norms
from workers.detectors import StepSignals, diagnose_depth


def metric_payload(s: StepSignals, *, applied: bool, clipped_norm: float, lr: float, loss_scale: float | None,
                   throughput: float | None) -> dict[str, Any]:
    """The ``metric`` event of one step; the post-clip norm only when the update was applied."""
    return {
        "step": s.step,
        "loss": finite_or_none(s.loss),
        "grad_norm": finite_or_none(s.grad_norm),
        "grad_norm_clipped": finite_or_none(clipped_norm) if applied else None,
        "lr": lr,
        "loss_scale": loss_scale,
        "throughput": throughput,
        "skipped": not applied,
    }


def layer_stats_payload(s: StepSignals, *, names: Sequence[str], layer_norms: Tensor,
                        depth_slope_threshold: float) -> dict[str, Any]:
    """The ``layer_stats`` event: this rank's per-parameter pre-clip grad norms (``names`` in the order of
    ``layer_norms``), the all-ranks per-block norms and update ratio, and the depth-profile diagnosis."""
    return {
        "step": s.step,
        "layer_grad_norms": {n: finite_or_none(v) for n, v in per_layer_norms(names, layer_norms).items()},
        "block_grad_norms": s.layer_grad_norms,
        "update_ratio": finite_or_none(s.update_ratio),
        "diagnosis": diagnose_depth(s.layer_grad_norms, depth_slope_threshold) if s.layer_grad_norms else None,
    }
