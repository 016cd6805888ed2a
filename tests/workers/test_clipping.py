"""Gradient norms and clipping, checked numerically against reference computations."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from contracts.recipe import Clipping
from workers.clipping import (
    ZSCORE_STD_FLOOR,
    Clipper,
    block_grad_norms,
    block_members,
    global_norm,
    grad_norms,
    param_snapshot,
    per_layer_norms,
    update_ratio,
)


def make_params(seed: int = 0, grad_scale: float = 1.0) -> list[tuple[str, nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"w1": (8, 5), "b1": (8,), "conv": (4, 3, 2, 2), "w2": (3, 8), "frozen": (3,)}
    out = []
    for name, shape in shapes.items():
        p = nn.Parameter(torch.randn(shape, generator=g))
        if name != "frozen":
            p.grad = torch.randn(shape, generator=g) * grad_scale
        out.append((name, p))
    return out


def clone_params(named: list[tuple[str, nn.Parameter]]) -> list[nn.Parameter]:
    out = []
    for _, p in named:
        q = nn.Parameter(p.detach().clone())
        q.grad = None if p.grad is None else p.grad.clone()
        out.append(q)
    return out


def grads_of(named: list[tuple[str, nn.Parameter]]) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in named if p.grad is not None}


def clip_with(cfg: Clipping, named: list[tuple[str, nn.Parameter]]) -> torch.Tensor:
    c = Clipper(cfg, named)
    return c.clip(grad_norms([p for _, p in named]))


def test_grad_norms_per_tensor_skipping_missing_grads() -> None:
    named = make_params()
    norms = grad_norms([p for _, p in named])
    expected = [p.grad.norm().item() for _, p in named if p.grad is not None]
    assert norms.shape == (4,)
    assert norms.tolist() == pytest.approx(expected, rel=1e-6)
    assert grad_norms([]).numel() == 0
    assert float(global_norm(grad_norms([]))) == 0.0


def test_global_norm_matches_torch() -> None:
    named = make_params()
    params = [p for _, p in named]
    ours = float(global_norm(grad_norms(params)))
    ref = float(torch.nn.utils.clip_grad_norm_(clone_params(named), max_norm=1e9))
    assert ours == pytest.approx(ref, rel=1e-6)


@pytest.mark.parametrize("max_norm", [0.5, 3.0, 1e3])
def test_global_norm_clipping_matches_clip_grad_norm(max_norm: float) -> None:
    named = make_params(grad_scale=2.0)
    ref_params = clone_params(named)
    ref_total = torch.nn.utils.clip_grad_norm_(ref_params, max_norm=max_norm)
    post = clip_with(Clipping(method="global_norm", max_norm=max_norm), named)
    got = [p.grad for _, p in named if p.grad is not None]
    for a, b in zip(got, [p.grad for p in ref_params if p.grad is not None], strict=True):
        torch.testing.assert_close(a, b)
    actual_post = float(global_norm(grad_norms([p for _, p in named])))
    assert float(post) == pytest.approx(actual_post, rel=1e-5)
    assert float(post) == pytest.approx(min(float(ref_total), max_norm), rel=1e-5)


def test_none_leaves_grads_alone_and_accepts_a_0dim_norm() -> None:
    named = make_params(grad_scale=100.0)
    before = grads_of(named)
    c = Clipper(Clipping(method="none"), named)
    total = global_norm(grad_norms([p for _, p in named]))
    assert float(c.clip(total)) == pytest.approx(float(total))
    for n, g in grads_of(named).items():
        assert torch.equal(g, before[n])


def test_per_layer_clips_each_tensor_to_max_norm() -> None:
    named = make_params(grad_scale=1.0)
    before = grads_of(named)
    max_norm = 4.0
    post = clip_with(Clipping(method="per_layer", max_norm=max_norm), named)
    expected_sq = 0.0
    for n, g in grads_of(named).items():
        norm = before[n].norm().item()
        ref = before[n] * min(1.0, max_norm / (norm + 1e-6))
        torch.testing.assert_close(g, ref)
        expected_sq += min(norm, max_norm) ** 2
    assert any(before[n].norm() > max_norm for n in before) and any(before[n].norm() < max_norm for n in before)
    assert float(post) == pytest.approx(math.sqrt(expected_sq), rel=1e-5)


def agc_reference(w: torch.Tensor, g: torch.Tensor, lam: float, eps: float) -> torch.Tensor:
    """Per-unit loop, written independently of the implementation."""
    out = g.clone()
    units = range(w.shape[0]) if w.dim() >= 2 else [None]
    for u in units:
        wu, gu = (w, g) if u is None else (w[u], g[u])
        max_n = max(wu.norm().item(), eps) * lam
        gn = gu.norm().item()
        if gn > max_n:
            if u is None:
                out = g * (max_n / gn)
            else:
                out[u] = g[u] * (max_n / gn)
    return out


def test_adaptive_clipping_is_unit_wise() -> None:
    named = make_params(grad_scale=1.0)
    # a zero-initialised row: its grads may still move by lam * eps
    named[0][1].data[2].zero_()
    lam, eps = 0.3, 1e-3
    before = grads_of(named)
    post = clip_with(Clipping(method="adaptive", agc_lambda=lam, agc_eps=eps), named)
    after = grads_of(named)
    clipped_any = unclipped_any = False
    for n, p in named:
        if p.grad is None:
            continue
        ref = agc_reference(p.detach(), before[n], lam, eps)
        torch.testing.assert_close(after[n], ref)
        if p.dim() >= 2:
            ratio = after[n].flatten(1).norm(dim=1) / p.detach().flatten(1).norm(dim=1).clamp_min(eps)
            assert (ratio <= lam * (1 + 1e-5)).all()
            clipped_any |= bool((before[n].flatten(1).norm(dim=1) > after[n].flatten(1).norm(dim=1) + 1e-7).any())
            unclipped_any |= bool(torch.isclose(before[n], after[n]).all(dim=tuple(range(1, p.dim()))).any())
    assert after["w1"][2].norm().item() == pytest.approx(lam * eps, rel=1e-4)
    assert clipped_any
    assert float(post) == pytest.approx(float(global_norm(grad_norms([p for _, p in named]))), rel=1e-5)


def test_adaptive_leaves_small_grads_unchanged() -> None:
    named = make_params(grad_scale=1e-4)
    before = grads_of(named)
    clip_with(Clipping(method="adaptive", agc_lambda=0.5), named)
    for n, g in grads_of(named).items():
        assert torch.equal(g, before[n])


class ZRef:
    """Independent z-score clipping reference: EMA of the clipped norm, starting as a running mean."""

    def __init__(self, cfg: Clipping) -> None:
        self.cfg, self.mean, self.var, self.n = cfg, 0.0, 0.0, 0

    def bound(self) -> float:
        if self.n < max(self.cfg.zscore_warmup, 1):
            return self.cfg.max_norm
        std = max(math.sqrt(self.var), ZSCORE_STD_FLOOR * self.mean)
        return min(self.mean + self.cfg.zscore_threshold * std, self.cfg.max_norm)

    def observe(self, norm: float) -> float:
        b = self.bound()
        if math.isfinite(norm):
            x = min(norm, b)
            a = max(self.cfg.zscore_alpha, 1 / (self.n + 1))
            d = x - self.mean
            self.mean += a * d
            self.var = (1 - a) * (self.var + a * d * d)
            self.n += 1
        return b


def norms_series(n: int, seed: int) -> list[float]:
    g = torch.Generator().manual_seed(seed)
    return (1.0 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)).abs().tolist()


def test_zscore_follows_reference_and_clips_a_spike_to_mean_plus_z_std() -> None:
    cfg = Clipping(method="zscore", max_norm=50.0, zscore_warmup=10, zscore_alpha=0.05, zscore_threshold=3.0)
    p = nn.Parameter(torch.zeros(4))
    clipper, ref = Clipper(cfg, [("p", p)]), ZRef(cfg)
    series = norms_series(60, seed=1)
    series[40] = 30.0  # spike
    for i, target in enumerate(series):
        p.grad = torch.tensor([target, 0.0, 0.0, 0.0])
        bound = ref.observe(target)
        post = float(clipper.clip(grad_norms([p])))
        assert post == pytest.approx(min(target, bound), rel=1e-5), i
        assert p.grad.norm().item() == pytest.approx(min(target, bound), rel=1e-5)
        if i == 40:
            assert 1.0 < post < 2.0  # clipped to about mean + 3 std, far below the spike and the ceiling
    st = clipper.state_dict()
    assert st["zscore_mean"] == pytest.approx(ref.mean, rel=1e-5)
    assert st["zscore_var"] == pytest.approx(ref.var, rel=1e-4)
    assert st["zscore_count"] == 60
    # the spike moved the mean by at most alpha * (bound - mean): the EMA did not absorb 30.0
    assert st["zscore_mean"] < 1.2


def test_zscore_uses_max_norm_during_warmup_and_as_ceiling() -> None:
    cfg = Clipping(method="zscore", max_norm=0.5, zscore_warmup=5, zscore_threshold=3.0)
    p = nn.Parameter(torch.zeros(2))
    clipper = Clipper(cfg, [("p", p)])
    for _ in range(20):
        p.grad = torch.tensor([3.0, 4.0])  # norm 5, always above the ceiling
        assert float(clipper.clip(grad_norms([p]))) == pytest.approx(0.5, rel=1e-5)
    assert clipper.zscore_bound == pytest.approx(0.5)


def test_zscore_ignores_non_finite_norms_and_round_trips_state() -> None:
    cfg = Clipping(method="zscore", max_norm=10.0, zscore_warmup=3)
    p = nn.Parameter(torch.zeros(3))
    a = Clipper(cfg, [("p", p)])
    for v in norms_series(8, seed=2):
        p.grad = torch.tensor([v, 0.0, 0.0])
        a.clip(grad_norms([p]))
    before = a.state_dict()
    p.grad = torch.tensor([float("nan"), 1.0, 0.0])
    a.clip(grad_norms([p]))
    p.grad = torch.tensor([float("inf"), 1.0, 0.0])
    a.clip(grad_norms([p]))
    assert a.state_dict() == before
    b = Clipper(cfg, [("p", p)])
    b.load_state_dict(before)
    for v in norms_series(10, seed=3):
        outs = []
        for c in (a, b):
            p.grad = torch.tensor([v * 3, 0.0, 0.0])
            outs.append(float(c.clip(grad_norms([p]))))
        assert outs[0] == outs[1]
    assert a.state_dict() == b.state_dict()


def test_bad_state_and_mismatched_norms_are_clear_errors() -> None:
    named = make_params()
    c = Clipper(Clipping(method="per_layer"), named)
    with pytest.raises(ValueError, match="zscore_mean"):
        c.load_state_dict({"mean": 1.0})
    with pytest.raises(ValueError, match="pre_norms has 2 entries"):
        c.clip(torch.ones(2))


def test_per_layer_norms_name_the_grad_norms() -> None:
    named = make_params()
    with_grad = [n for n, p in named if p.grad is not None]
    by_name = per_layer_norms(with_grad, grad_norms([p for _, p in named]))
    assert set(by_name) == {"w1", "b1", "conv", "w2"}
    conv_grad = named[2][1].grad
    assert conv_grad is not None
    assert by_name["conv"] == pytest.approx(conv_grad.norm().item(), rel=1e-6)
    with pytest.raises(ValueError):  # names and norms must describe the same parameters
        per_layer_norms(["w1"], grad_norms([p for _, p in named]))


def test_block_grad_norms_from_the_per_tensor_norms() -> None:
    blocks = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    for i, b in enumerate(blocks):
        for q in b.parameters():
            q.grad = torch.full_like(q, float(i))
    for q in blocks[0].parameters():  # block 0 is frozen: not among the trainable (grad-norm) parameters
        q.requires_grad_(False)
        q.grad = None
    model = nn.Sequential(*blocks)
    owner = {name: int(name.split(".")[0]) for name, _ in model.named_parameters()}
    trainable = [(n, q) for n, q in model.named_parameters() if q.requires_grad]
    members = block_members([n for n, _ in trainable], owner)
    assert [m.tolist() for m in members] == [[], [0, 1], [2, 3]]
    norms = block_grad_norms(grad_norms([q for _, q in trainable]), members)
    assert norms[0] == 0.0
    assert float(norms[2]) == pytest.approx(2.0 * math.sqrt(20), rel=1e-6)
    for i in (1, 2):  # a block's norm is the norm of all its grads taken together
        flat = torch.cat([q.grad.flatten() for q in blocks[i].parameters() if q.grad is not None])
        assert float(norms[i]) == pytest.approx(flat.norm().item(), rel=1e-6)
    assert block_grad_norms(torch.zeros(0), []).numel() == 0  # a model without blocks
    assert block_members(["a"], {}) == []


def test_update_ratio() -> None:
    blocks = [nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)]
    params = [q for b in blocks for q in b.parameters()]
    snap = param_snapshot(params)
    with torch.no_grad():
        blocks[1].weight.add_(0.01)
    w_norm = math.sqrt(sum(q.detach().pow(2).sum().item() for q in params))
    ratio = update_ratio(snap, params)
    assert ratio.dim() == 0 and float(ratio) == pytest.approx(0.01 * 4 / w_norm, rel=1e-5)
    # get_total_norm is the global norm of the per-tensor norms, bit for bit (what the loop measured before)
    diffs = [q.detach() - s for q, s in zip(params, snap, strict=True)]
    explicit = global_norm(grad_norms_of(diffs)) / global_norm(grad_norms_of(params)).clamp_min(1e-12)
    assert torch.equal(ratio, explicit)
    with pytest.raises(ValueError, match="snapshot has 1 tensors"):
        update_ratio(snap[:1], params)
    assert float(update_ratio([], [])) == 0.0


def grad_norms_of(tensors: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(torch._foreach_norm([t.detach() for t in tensors])).float()
