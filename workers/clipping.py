"""Gradient norms and clipping: fused multi-tensor norms, and the five clipping methods of the recipe.

Everything on the per-step path stays on the device: norms come from one ``torch._foreach_norm`` call, scaling
from ``torch._foreach_mul_`` with a 0-dim tensor, and the z-score EMA lives in 0-dim tensors updated with
``torch.where``. The loop can therefore gather loss, norms and finite flags into one tensor and sync once per
step. The every-k-steps telemetry helpers work from the same norms: ``block_grad_norms`` and ``update_ratio``
stay on the device (they travel in the loop's signals gather); ``per_layer_norms`` comes back to the host with
one ``.tolist()``.

Order in the loop: backward → ``LossScaler.unscale_`` → ``pre = grad_norms(params)`` → ``clipper.clip(pre)``;
the detectors see ``global_norm(pre)`` (the pre-clip norm) and the telemetry reports both.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import get_total_norm

from contracts.recipe import ClipMethod, Clipping
from workers.sharding import all_reduce_sum, any_sharded, local, shard_sq_sums, sharded_norms

_EPS = 1e-6
"""Added to norms in divisions, as ``torch.nn.utils.clip_grad_norm_`` does."""
ZSCORE_STD_FLOOR = 0.01
"""Z-score clipping: the std used is at least this fraction of the EMA mean, so a run whose norms were
identical during warmup (zero variance) is not clipped at every tiny fluctuation."""


def _grads(params: Iterable[Tensor]) -> list[Tensor]:
    """The gradients to scale in place: this rank's local shards under FSDP (``sharding.local``)."""
    return [local(p.grad) for p in params if p.grad is not None]


def _stack_norms(tensors: Sequence[Tensor]) -> Tensor:
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    norms = torch._foreach_norm(list(tensors), 2.0, dtype=torch.float32)
    device = norms[0].device
    return torch.stack([n if n.device == device else n.to(device) for n in norms])


def grad_norms(params: Iterable[Tensor]) -> Tensor:
    """Per-tensor L2 norms (float32) of the gradients of ``params``, stacked; parameters without a grad are
    skipped, so the i-th entry belongs to the i-th parameter *that has a grad*. Under FSDP the gradients are
    shards: their squared sums are all-reduced (one small all-reduce), so every rank gets the global norms."""
    grads = [p.grad for p in params if p.grad is not None]
    if any_sharded(grads):
        return sharded_norms(grads)
    return _stack_norms(grads)


def global_norm(stacked: Tensor) -> Tensor:
    """The global L2 norm (0-dim) from stacked per-tensor norms: sqrt of the sum of their squares."""
    if stacked.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=stacked.device)
    norm: Tensor = torch.linalg.vector_norm(stacked.float(), 2.0)
    return norm


def _mul_(grads: list[Tensor], coef: Tensor) -> None:
    """In-place ``g *= coef`` for every grad, grouped by device (the common case is a single group)."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    for device, group in by_device.items():
        torch._foreach_mul_(group, coef.to(device))


class Clipper:
    """Clips gradients in place according to ``cfg.method`` and returns the post-clip global norm.

    ``clip(pre_norms)`` takes the stacked per-tensor norms from ``grad_norms`` over the same parameters, in the
    same order (``[p for _, p in named_params]``); a 0-dim global norm is accepted too and the per-tensor norms
    are then computed here when the method needs them. Methods:

    - ``none``: nothing is changed.
    - ``global_norm``: ``torch.nn.utils.clip_grad_norm_`` semantics: scale all grads by
      ``min(1, max_norm / (norm + 1e-6))``.
    - ``per_layer``: each parameter tensor separately to ``max_norm``.
    - ``adaptive`` (AGC, Brock et al. 2021): per output unit (row of a >=2-D weight; the whole tensor for 1-D
      parameters) the grad norm is capped at ``agc_lambda * max(weight norm, agc_eps)``.
    - ``zscore``: the bound is ``min(max_norm, mean + zscore_threshold * std)`` of an EMA (``zscore_alpha``) of the
      global norm; ``max_norm`` is a hard ceiling, so z-score clipping never lets through more than
      ``global_norm`` clipping would. During the first ``zscore_warmup`` finite steps the bound is ``max_norm``.
      The EMA absorbs the *clipped* norm ``min(norm, bound)`` (as ZClip does), so an outlier moves it by at most
      one bound's worth; non-finite norms are not absorbed at all.

    Non-finite grads are scaled by a NaN coefficient like ``clip_grad_norm_`` would; the loop skips that update.
    """

    def __init__(self, cfg: Clipping, named_params: Sequence[tuple[str, nn.Parameter]]) -> None:
        self.cfg = cfg
        self.method = ClipMethod(cfg.method)
        self.names = [n for n, _ in named_params]
        self.params = [p for _, p in named_params]
        self._z_mean = 0.0
        self._z_var = 0.0
        self._z_count = 0
        self._z: tuple[Tensor, Tensor, Tensor] | None = None  # (mean, var, count) on the grads' device

    # ---------------------------------------------------------------------------------------------- clipping
    def clip(self, pre_norms: Tensor) -> Tensor:
        """Clip the current grads in place; returns the post-clip global norm (0-dim, no host sync)."""
        grads = _grads(self.params)
        if pre_norms.dim() == 0:
            total = pre_norms.float()
            per_tensor: Tensor | None = None
        else:
            if pre_norms.numel() != len(grads):
                raise ValueError(
                    f"pre_norms has {pre_norms.numel()} entries but {len(grads)} parameters have grads; "
                    "compute it with grad_norms() over the Clipper's parameters"
                )
            per_tensor = pre_norms.float()
            total = global_norm(per_tensor)
        if not grads or self.method is ClipMethod.none:
            return total
        if self.method is ClipMethod.global_norm:
            return self._clip_to(grads, total, torch.full_like(total, self.cfg.max_norm))
        if self.method is ClipMethod.per_layer:
            if per_tensor is None:
                per_tensor = grad_norms(self.params)
            coefs = (self.cfg.max_norm / (per_tensor + _EPS)).clamp(max=1.0)
            torch._foreach_mul_(grads, [c.to(g.device) for c, g in zip(coefs.unbind(0), grads, strict=True)])
            return global_norm(per_tensor * coefs)
        if self.method is ClipMethod.adaptive:
            return self._clip_agc()
        return self._clip_zscore(grads, total)

    def scale_to(self, bound: float, total: float) -> None:
        """Scale the grads, whose global norm is ``total`` (after ``clip``), down to at most ``bound``: the
        guard's own clip of a recurring spike (``DetectorSuite._recurring_spike_bound``), on top of the recipe's."""
        grads = _grads(self.params)
        if grads and total > bound:
            _mul_(grads, torch.tensor(bound / (total + _EPS), dtype=torch.float32))

    def _clip_to(self, grads: list[Tensor], total: Tensor, bound: Tensor) -> Tensor:
        coef = (bound / (total + _EPS)).clamp(max=1.0)
        _mul_(grads, coef)
        return total * coef

    def _clip_agc(self) -> Tensor:
        """Per output row (dim 0) of a >=2-D weight, the whole tensor for the others. Under FSDP the shards split
        dim 0, so a row is whole on one rank; whole-tensor norms and the post-clip total are all-reduced."""
        lam, eps = self.cfg.agc_lambda, self.cfg.agc_eps
        pairs = [(p, p.grad) for p in self.params if p.grad is not None]
        sharded = any_sharded(g for _, g in pairs)
        whole = self._whole_tensor_norms(pairs, sharded)
        post_sq: list[Tensor] = []
        for i, (p, g) in enumerate(pairs):
            w, grad = local(p.detach()), local(g)
            if p.dim() >= 2:
                dims = tuple(range(1, p.dim()))
                w_norm = torch.linalg.vector_norm(w.float(), 2.0, dim=dims, keepdim=True)
                g_norm = torch.linalg.vector_norm(grad.float(), 2.0, dim=dims, keepdim=True)
            else:
                w_norm, g_norm = whole[i]
            scale = (w_norm.clamp_min(eps) * lam / g_norm.clamp_min(_EPS)).clamp(max=1.0)
            grad.mul_(scale.to(grad.dtype))
            if sharded and p.dim() < 2:  # a global norm: count this rank's part only, the all-reduce adds the rest
                post_sq.append(local(grad).float().square().sum())
            else:
                post_sq.append(((g_norm * scale) ** 2).sum())
        total = all_reduce_sum(torch.stack(post_sq).sum().reshape(1), sharded)
        return total.reshape(()).sqrt()

    @staticmethod
    def _whole_tensor_norms(pairs: Sequence[tuple[Tensor, Tensor]], sharded: bool) -> dict[int, tuple[Tensor, Tensor]]:
        """(weight norm, grad norm) of every <2-D parameter in ``pairs`` (keepdim shape), global under FSDP."""
        flat = [i for i, (p, _) in enumerate(pairs) if p.dim() < 2]
        if not flat:
            return {}
        if not sharded:
            return {i: (torch.linalg.vector_norm(pairs[i][0].detach().float(), 2.0, dim=None, keepdim=True),
                        torch.linalg.vector_norm(pairs[i][1].float(), 2.0, dim=None, keepdim=True)) for i in flat}
        tensors = [pairs[i][0].detach() for i in flat] + [pairs[i][1] for i in flat]
        norms = all_reduce_sum(shard_sq_sums(tensors), True).sqrt()
        shape = [(1,) * pairs[i][0].dim() for i in flat]
        n = len(flat)
        return {i: (norms[k].reshape(shape[k]), norms[n + k].reshape(shape[k])) for k, i in enumerate(flat)}

    def _zstate(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        if self._z is None or self._z[0].device != device:
            vals = [self._z_mean, self._z_var, float(self._z_count)]
            mean, var, count = (torch.tensor(v, dtype=torch.float32, device=device) for v in vals)
            self._z = (mean, var, count)
        return self._z

    def _clip_zscore(self, grads: list[Tensor], total: Tensor) -> Tensor:
        cfg = self.cfg
        mean, var, count = self._zstate(total.device)
        std = torch.maximum(var.sqrt(), mean.abs() * ZSCORE_STD_FLOOR)
        ceiling = torch.full_like(total, cfg.max_norm)
        in_warmup = count < max(cfg.zscore_warmup, 1)
        bound = torch.where(in_warmup, ceiling, torch.minimum(mean + cfg.zscore_threshold * std, ceiling))
        post = self._clip_to(grads, total, bound)
        # EMA of the clipped norm; alpha starts at 1/(n+1) (a plain running mean) so early estimates are unbiased
        finite = torch.isfinite(total)
        x = torch.minimum(total, bound)
        alpha = torch.clamp(1.0 / (count + 1.0), min=cfg.zscore_alpha)
        delta = x - mean
        new_mean = mean + alpha * delta
        new_var = (1.0 - alpha) * (var + alpha * delta * delta)
        self._z = (
            torch.where(finite, new_mean, mean),
            torch.where(finite, new_var, var),
            count + finite.float(),
        )
        return post

    # ------------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """The z-score EMA as plain Python numbers (a host sync: call it only when checkpointing)."""
        if self._z is not None:
            mean, var, count = (float(t) for t in self._z)
            self._z_mean, self._z_var, self._z_count = mean, var, int(count)
        return {"zscore_mean": self._z_mean, "zscore_var": self._z_var, "zscore_count": self._z_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            mean = float(state["zscore_mean"])
            var = float(state["zscore_var"])
            count = int(state["zscore_count"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"invalid clipper state (need zscore_mean, zscore_var, zscore_count): {exc}") from None
        if not (math.isfinite(mean) and math.isfinite(var) and var >= 0.0 and count >= 0):
            raise ValueError(f"invalid clipper state: mean={mean}, var={var}, count={count}")
        self._z_mean, self._z_var, self._z_count = mean, var, count
        self._z = None

    @property
    def zscore_bound(self) -> float | None:
        """The z-score bound the next step would use (host sync; for tests and telemetry), None before warmup."""
        st = self.state_dict()
        mean, var, count = float(st["zscore_mean"]), float(st["zscore_var"]), int(st["zscore_count"])
        if count < max(self.cfg.zscore_warmup, 1):
            return None
        std = max(math.sqrt(var), abs(mean) * ZSCORE_STD_FLOOR)
        return min(mean + self.cfg.zscore_threshold * std, self.cfg.max_norm)


# ---------------------------------------------------------------------------------------- telemetry helpers
def per_layer_norms(names: Sequence[str], norms: Tensor) -> dict[str, float]:
    """Grad norm per named parameter for the every-k-steps ``layer_stats`` event: ``names`` are the parameters
    that ``norms`` (from ``grad_norms``) was computed over, in the same order. One host sync."""
    return {n: float(v) for n, v in zip(names, norms.tolist(), strict=True)}


def block_members(names: Sequence[str], owner: Mapping[str, int], device: torch.device | None = None) -> list[Tensor]:
    """For each block (numbered by ``owner``: parameter name → block index, as ``models.param_block_index``), the
    positions in ``names`` (the grad-norm order) of its parameters; a block none of ``names`` belongs to (frozen)
    gets an empty index. Computed once per attempt, for ``block_grad_norms``."""
    n_blocks = max(owner.values(), default=-1) + 1
    members: list[list[int]] = [[] for _ in range(n_blocks)]
    for i, name in enumerate(names):
        if name in owner:
            members[owner[name]].append(i)
    return [torch.tensor(m, dtype=torch.long, device=device) for m in members]


def block_grad_norms(norms: Tensor, members: Sequence[Tensor]) -> Tensor:
    """Grad norm of each block (all its parameters together), in input→output order, from the stacked per-tensor
    norms (``grad_norms``) and ``block_members``; a block with no trainable parameters (frozen) gets 0.0, which
    the depth-profile fit ignores. Stays on the device (the loop gathers it with the step's signals)."""
    if not members:
        return torch.zeros(0, device=norms.device)
    sq = norms.float() ** 2
    zero = torch.zeros((), device=norms.device)
    return torch.stack([sq[idx].sum() if idx.numel() else zero for idx in members]).sqrt()


def param_snapshot(params: Iterable[Tensor]) -> list[Tensor]:
    """Detached copies of the parameters, taken before ``optimizer.step()`` on a layer-stats step only (it costs
    one copy of the weights), for ``update_ratio``. Under FSDP: this rank's shards."""
    return [local(p.detach()).clone() for p in params]


def update_ratio(before: Sequence[Tensor], params: Iterable[Tensor]) -> Tensor:
    """``||w_after - w_before|| / ||w_after||`` over all parameters (global L2 norms, as
    ``torch.nn.utils.get_total_norm``) after ``optimizer.step()``: the update-to-weight ratio the stagnation
    detector watches. 0-dim, on the parameters' device, no host sync."""
    params = list(params)
    after = [local(p.detach()) for p in params]
    if len(after) != len(before):
        raise ValueError(f"snapshot has {len(before)} tensors but there are {len(after)} parameters")
    if not after:
        return torch.zeros((), dtype=torch.float32)
    diffs = torch._foreach_sub(after, list(before))
    if any_sharded(params):  # shards: the two squared totals over all ranks, one all-reduce
        sq = all_reduce_sum(torch.stack([shard_sq_sums(diffs).sum(), shard_sq_sums(after).sum()]), True)
        sharded_ratio: Tensor = sq[0].sqrt() / sq[1].sqrt().clamp_min(1e-12)
        return sharded_ratio
    ratio: Tensor = get_total_norm(diffs) / get_total_norm(after).clamp_min(1e-12)
    return ratio
