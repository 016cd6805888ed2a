"""Precision: autocast per dtype and the loss scaler's dynamic/static/none behaviour on CPU."""

from __future__ import annotations

import pytest
import torch

from contracts.recipe import Precision
from workers.precision import LossScaler, autocast


def _grads_after(scaler: LossScaler, model: torch.nn.Module, opt: torch.optim.Optimizer) -> torch.Tensor:
    torch.manual_seed(0)
    with autocast(Precision().dtype, "cpu"):
        loss = model(torch.randn(8, 4)).pow(2).mean()
    scaler.scale(loss).backward()  # type: ignore[no-untyped-call]
    scaler.unscale_(opt)
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).clone()


@pytest.mark.parametrize(("dtype", "expected"), [("fp32", torch.float32), ("bf16", torch.bfloat16),
                                                  ("fp16", torch.float16)])
def test_autocast_sets_compute_dtype(dtype: str, expected: torch.dtype) -> None:
    lin = torch.nn.Linear(4, 4)
    with autocast(dtype, "cpu"):
        out = lin(torch.randn(2, 4))
    assert out.dtype == expected
    assert lin.weight.dtype == torch.float32  # master weights untouched


def test_scaling_only_for_fp16() -> None:
    assert LossScaler(Precision(dtype="bf16")).mode.value == "none"
    assert LossScaler(Precision(dtype="fp32", loss_scaling="static")).mode.value == "none"
    assert LossScaler(Precision(dtype="fp16")).mode.value == "dynamic"


@pytest.mark.parametrize("mode", ["dynamic", "static", "none"])
def test_unscaled_grads_match_unscaled_loss(mode: str) -> None:
    torch.manual_seed(0)
    ref_model = torch.nn.Linear(4, 1)
    model = torch.nn.Linear(4, 1)
    model.load_state_dict(ref_model.state_dict())
    ref = _grads_after(LossScaler(Precision()), ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1))
    cfg = Precision(dtype="fp16", loss_scaling=mode, init_scale=1024.0, static_scale=256.0)
    scaler = LossScaler(cfg)
    got = _grads_after(scaler, model, torch.optim.SGD(model.parameters(), lr=0.1))
    torch.testing.assert_close(got, ref)
    expected_scale = {"dynamic": 1024.0, "static": 256.0, "none": 1.0}[mode]
    assert float(scaler.scale_tensor()) == expected_scale


def test_dynamic_scale_backs_off_on_the_agreed_flag_and_grows_after_interval() -> None:
    scaler = LossScaler(Precision(dtype="fp16", init_scale=1024.0, growth_interval=2, backoff_factor=0.5))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scales = []
    # the local grads are finite every step; the all-reduced flag says another rank overflowed at step 1
    for found_inf in (False, True, False, False):
        _grads_after(scaler, model, opt)
        scaler.update(torch.tensor(float(found_inf)))
        scales.append(float(scaler.scale_tensor()))
        opt.zero_grad()
    assert scales == [1024.0, 512.0, 512.0, 1024.0]


def test_dynamic_state_roundtrip() -> None:
    cfg = Precision(dtype="fp16", init_scale=1024.0)
    scaler = LossScaler(cfg)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _grads_after(scaler, model, opt)
    scaler.update(True)
    fresh = LossScaler(cfg)
    fresh.load_state_dict(scaler.state_dict())
    assert float(fresh.scale_tensor()) == 512.0
    # a retry that switched fp16 -> bf16 starts without a scaler instead of failing on the old state
    bf16 = LossScaler(Precision(dtype="bf16"))
    bf16.load_state_dict(scaler.state_dict())
    assert float(bf16.scale_tensor()) == 1.0


def test_update_without_unscale_is_an_error() -> None:
    scaler = LossScaler(Precision(dtype="fp16"))
    with pytest.raises(RuntimeError, match="unscale_"):
        scaler.update(False)
