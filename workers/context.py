"""Where this process stands in its worker group, and the few collectives the loop makes.

``WorkerContext`` is rank, world size, device and where checkpoints go (the attempt's directory, or under Ray
Train the launch's ``checkpoint_uri_prefix``). The collectives are no-ops at world size 1, so the same loop runs
in a plain process, in an initialised ``torch.distributed`` group and under Ray Train.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from contracts.recipe import Recipe
from contracts.storage import StorageOptions


@dataclass(frozen=True)
class WorkerContext:
    """Rank, world size and device of this process, and how checkpoints leave it."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ray_train: bool = False
    """Running under Ray Train: checkpoints go to ``checkpoint_uri_prefix`` (Ray Train's run directory)."""
    checkpoint_uri_prefix: str | None = None
    """Ray Train: where rank 0 writes checkpoints (``<prefix>/step_XXXXXXXX`` is a checkpoint's URI)."""
    storage: StorageOptions = field(default_factory=StorageOptions)
    """How to reach an object-store checkpoint URI (endpoint, keys) when resuming from one."""
    node: str = ""
    """The Ray node this rank runs on (empty in a plain process); checkpoints record every rank's."""

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def plain_context(recipe: Recipe) -> WorkerContext:
    """The context of a plain process: world size 1, or this rank of an already initialised process group."""
    use_cuda = recipe.resources.use_gpu and torch.cuda.is_available()
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        return WorkerContext(rank=rank, world_size=world, device=device)
    return WorkerContext(device=torch.device("cuda") if use_cuda else torch.device("cpu"))


def gather_rows(local: Tensor, ctx: WorkerContext) -> list[list[float]]:
    """All ranks' 1-D vectors (same length on every rank), as host floats in rank order: one all-gather and
    one host sync."""
    if not ctx.distributed:
        return [local.tolist()]
    out = torch.empty(ctx.world_size * local.numel(), dtype=local.dtype, device=local.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local)
    rows: list[list[float]] = out.view(ctx.world_size, -1).tolist()
    return rows


def gather_objects(obj: Any, ctx: WorkerContext) -> list[Any]:
    """Every rank's ``obj`` (picklable), in rank order, on every rank."""
    if not ctx.distributed:
        return [obj]
    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any, ctx: WorkerContext) -> Any:
    """Rank 0's ``obj`` on every rank."""
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier(ctx: WorkerContext) -> None:
    if ctx.distributed:
        dist.barrier()
