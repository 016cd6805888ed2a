"""FSDP (``distributed.strategy: fsdp``): sharding the model with FSDP2, and the reductions a sharded step needs.

``shard_model`` applies FSDP2's ``fully_shard`` to every block the model has (``models.blocks``: tiny_gpt's
blocks, deep_mlp's layers, a custom model's found blocks) and then to the root, so each block's parameters are
all-gathered just before its forward/backward and resharded after. ``fully_shard`` keeps the module object and its
parameter names; the parameters become ``DTensor`` shards (dim 0 split across the ranks), and so do their
gradients and the optimizer state. At world size 1 nothing is sharded (the module stays a plain one) but the
checkpoint format is the sharded one, so a world-size-1 run resumes a world-size-N checkpoint and vice versa.

The guard's numbers stay global and cheap: the loop's per-tensor gradient norms come from the local shards' squared
sums with **one** all-reduce of a vector of one float per parameter tensor (``shard_sq_sums`` → ``all_reduce_sum``),
after which every rank holds the same per-tensor norms DDP would have: the global norm, the per-block norms, the
clipping coefficients and the signals gather are unchanged. Clipping then scales each rank's local shards in place
(``local``). The few computations that need more than per-tensor norms (adaptive clipping of 1-D parameters, the
update ratio, the weights-finite check of a checkpoint's verdict) reduce their local parts the same way.

Everything here is a no-op on plain tensors, so the DDP and single-process paths run the same code.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn

from contracts.recipe import Recipe, Strategy
from workers.context import WorkerContext
from workers.models.blocks import model_blocks


def fsdp_enabled(recipe: Recipe) -> bool:
    return recipe.distributed.strategy is Strategy.fsdp


def check_full_resume(recipe: Recipe, ctx: WorkerContext) -> None:
    """A full (``strategy: ddp``) checkpoint resumes an FSDP run only at world size 1, where nothing is sharded:
    its optimizer state is indexed by position and holds whole tensors, which a sharded optimizer cannot take."""
    if fsdp_enabled(recipe) and ctx.distributed:
        from workers.comm import EngineConfigError

        raise EngineConfigError(
            "distributed.strategy: fsdp at world size "
            f"{ctx.world_size} cannot resume a full (strategy: ddp) checkpoint; resume it with strategy: ddp, or "
            "at world size 1 (whose next checkpoints are sharded and resume at any world size)"
        )


def is_sharded(t: Tensor | None) -> bool:
    """Whether ``t`` is a ``DTensor`` (an FSDP-sharded parameter or gradient)."""
    if t is None:
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """This rank's shard of a ``DTensor`` (a view: in-place ops change the parameter/gradient), else ``t``."""
    if is_sharded(t):
        out: Tensor = t.to_local()  # type: ignore[attr-defined]
        return out
    return t


def any_sharded(tensors: Iterable[Tensor]) -> bool:
    return any(is_sharded(t) for t in tensors)


def all_reduce_sum(t: Tensor, sharded: bool) -> Tensor:
    """Sum ``t`` over the ranks in place when the tensors it came from are sharded (a no-op otherwise)."""
    if sharded and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def shard_sq_sums(tensors: Sequence[Tensor]) -> Tensor:
    """Per-tensor squared L2 norms (float32) of this rank's local shards, stacked (one fused ``_foreach_norm``)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    norms = torch._foreach_norm([local(t) for t in tensors], 2.0, dtype=torch.float32)
    device = norms[0].device
    return torch.stack([n if n.device == device else n.to(device) for n in norms]) ** 2


def sharded_norms(tensors: Sequence[Tensor]) -> Tensor:
    """Per-tensor global L2 norms of sharded tensors: local squared sums, one all-reduce, sqrt."""
    return all_reduce_sum(shard_sq_sums(tensors), True).sqrt()


def all_finite(tensors: Sequence[Tensor]) -> bool:
    """Whether every element of every tensor is finite, over all ranks' shards (one all-reduce when sharded)."""
    if not tensors:
        return True
    locals_ = [local(t.detach()) for t in tensors]
    bad = (~torch.isfinite(torch.stack(torch._foreach_norm(locals_)))).any().float().reshape(1)
    return bool(all_reduce_sum(bad, any_sharded(tensors)).item() == 0)


def shard_model(module: nn.Module, device: torch.device) -> nn.Module:
    """FSDP2 ``fully_shard`` on every found block, then on the root (in place; returns ``module``).

    Blocks without parameters (or with only frozen ones: ``freeze_first_n_blocks``) are still their own unit;
    FSDP2 reduce-scatters only the gradients that exist. The mesh is the default process group's ranks on
    ``device``'s type (gloo on CPU, NCCL on GPU).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model_blocks(module):
        if any(True for _ in block.parameters()):
            fully_shard(block, mesh=mesh)
    fully_shard(module, mesh=mesh)
    return module


def is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


@contextlib.contextmanager
def fsdp_no_sync(module: nn.Module) -> Iterator[None]:
    """Micro-batches before the last: accumulate unsharded gradients locally, reduce-scatter on the last one."""
    module.set_requires_gradient_sync(False)  # type: ignore[operator]
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)  # type: ignore[operator]
