"""The signals packet: pack/unpack by name, and the one StepSignals every rank derives from the gathered rows."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import pytest
import torch

from workers.context import WorkerContext
from workers.signals import RankSignals, combine, gather


def packet(**values: Any) -> RankSignals[float]:
    base: dict[str, Any] = {"loss": 2.0, "grad_norm": 1.0, "loss_nonfinite": 0.0, "grads_nonfinite": 0.0,
                            "stop": 0.0, "loss_scale": 1.0, "clipped_norm": 1.0, "update_ratio": math.nan}
    return RankSignals(**{**base, **values})


def test_scalars_are_the_fields_in_order() -> None:
    assert RankSignals.SCALARS == tuple(f.name for f in fields(RankSignals))[:-1]
    assert [f.name for f in fields(RankSignals)][-1] == "block_norms"


def test_pack_then_unpack_is_the_same_packet() -> None:
    t = {name: torch.tensor(float(i + 1)) for i, name in enumerate(RankSignals.SCALARS)}
    blocks = (torch.tensor(0.5), torch.tensor(0.25))
    packed = RankSignals(**t, block_norms=blocks).pack()
    assert packed.tolist() == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 0.5, 0.25]
    back = RankSignals.unpack(packed.tolist())
    assert back == RankSignals(**{n: float(i + 1) for i, n in enumerate(RankSignals.SCALARS)}, block_norms=(0.5, 0.25))
    # world size 1: the gather is the packet itself
    assert gather(RankSignals(**t), WorkerContext()) == [RankSignals.unpack(RankSignals(**t).pack().tolist())]


def test_combine_mean_loss_largest_norm_and_maxima_over_ranks() -> None:
    rows = [packet(loss=1.0, grad_norm=3.0, clipped_norm=0.5, update_ratio=0.01, block_norms=(1.0, 4.0)),
            packet(loss=3.0, grad_norm=5.0, clipped_norm=0.75, block_norms=(2.0, 3.0), stop=1.0)]
    g = combine(7, rows, fp16_dynamic=False, layer_step=True)
    s = g.signals
    assert (s.step, s.loss, s.grad_norm, s.rank, s.finite) == (7, 2.0, 5.0, 1, True)
    assert s.layer_grad_norms == [2.0, 4.0] and s.update_ratio == 0.01
    assert s.loss_scale is None and s.overflow is False
    assert g.clipped_norm == 0.75 and g.stop_requested is True
    # not a layer-stats step: no per-block norms even if packed; no finite ratio → None
    g = combine(8, [packet(block_norms=(1.0,))], fp16_dynamic=False, layer_step=False)
    assert g.signals.layer_grad_norms is None and g.signals.update_ratio is None and g.stop_requested is False


def test_combine_non_finite_rank_decides_for_everyone() -> None:
    rows = [packet(grad_norm=9.0, loss_scale=1024.0), packet(grad_norm=math.inf, grads_nonfinite=1.0),
            packet(loss=math.nan, loss_nonfinite=1.0)]
    s = combine(3, rows, fp16_dynamic=True, layer_step=False).signals
    assert s.finite is False and s.rank == 1 and s.grad_norm == math.inf
    assert s.overflow is True and s.loss_scale == 1024.0  # rank 0's scale under dynamic fp16
    assert math.isnan(s.loss)
    only_loss = combine(3, [packet(), packet(loss=math.inf, loss_nonfinite=1.0)], fp16_dynamic=True,
                        layer_step=False).signals
    assert only_loss.finite is False and only_loss.overflow is False and only_loss.rank == 1


@pytest.mark.parametrize("n_blocks", [0, 3])
def test_unpack_splits_the_block_tail(n_blocks: int) -> None:
    row = [float(i) for i in range(len(RankSignals.SCALARS) + n_blocks)]
    assert len(RankSignals.unpack(row).block_norms) == n_blocks
