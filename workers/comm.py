"""Gradient communication: DDP wrapping, the recipe's comm hooks, and PowerSGD's state across a resume.

``distributed.compression`` picks the hook: ``fp16`` / ``bf16`` compress the all-reduce (bf16 needs NCCL),
``powersgd`` replaces it by a low-rank approximation with error feedback. PowerSGD's error feedback, low-rank
memories and RNG are per-rank state a checkpoint must carry for a resume to replay exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from contracts.recipe import Compression, Recipe, Strategy
from workers.context import WorkerContext, gather_objects
from workers.data import Batch
from workers.objective import Objective
from workers.sharding import fsdp_no_sync, is_fsdp


class EngineConfigError(ValueError):
    """A recipe setting this engine or backend cannot run; the message starts with the field path."""


def check_backend(recipe: Recipe, ctx: WorkerContext) -> None:
    """Refuse compression settings the worker group's backend cannot run, naming the field."""
    comp = recipe.distributed.compression
    if ctx.distributed and ctx.ray_train and recipe.distributed.strategy is Strategy.fsdp:
        nodes = sorted(set(gather_objects(ctx.node, ctx)))
        if len(nodes) > 1:  # the shards are staged in a node-local directory (workers/sharded_checkpoint.py)
            raise EngineConfigError(
                f"distributed.strategy: fsdp under Ray Train needs every rank on one node (this group spans "
                f"{len(nodes)}): sharded checkpoints are assembled in a node-local directory. Use strategy: ddp "
                "across nodes."
            )
    if not ctx.distributed or comp is Compression.none:
        return
    backend = dist.get_backend()
    if comp is Compression.bf16 and backend != "nccl":
        raise EngineConfigError(
            f"distributed.compression: bf16 compression needs NCCL (resources.use_gpu: true); this worker "
            f"group uses {backend}. Use fp16 or powersgd compression on CPU."
        )
    if comp is Compression.powersgd and recipe.distributed.powersgd_start_iter < 2:
        raise EngineConfigError(
            "distributed.powersgd_start_iter: must be >= 2 (PowerSGD's error feedback needs a vanilla "
            "allreduce step first)"
        )


def wrap_ddp(module: nn.Module, recipe: Recipe, device: torch.device) -> tuple[nn.Module, Any]:
    """``module`` in ``DistributedDataParallel`` with the recipe's comm hook → (ddp, PowerSGD state or None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(module, device_ids=device_ids)
    d = recipe.distributed
    state: Any = None
    if d.compression is Compression.fp16:
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif d.compression is Compression.bf16:
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif d.compression is Compression.powersgd:
        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=d.powersgd_rank,
            start_powerSGD_iter=d.powersgd_start_iter, random_seed=recipe.training.seed,
        )
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    return ddp, state


def no_sync(model: nn.Module, module: nn.Module, skip_sync: bool) -> contextlib.AbstractContextManager[Any]:
    """DDP's ``no_sync()`` when ``skip_sync`` and ``model`` wraps ``module`` (micro-batches before the last);
    FSDP's ``set_requires_gradient_sync(False)`` when ``module`` is sharded (``sharding.fsdp_no_sync``)."""
    if skip_sync and is_fsdp(module):
        return fsdp_no_sync(module)
    if skip_sync and model is not module:
        ctx: contextlib.AbstractContextManager[Any] = model.no_sync()  # type: ignore[operator]
        return ctx
    return contextlib.nullcontext()


def prime_ddp_buckets(model: nn.Module, module: nn.Module, objective: Objective, batch: Batch) -> None:
    """One zero-loss forward/backward before PowerSGD's state is restored.

    PowerSGD keys its error-feedback and low-rank memories by DDP bucket, and DDP re-orders the tensors in its
    buckets after the first iteration (the reason PowerSGD needs ``start_powerSGD_iter >= 2``). A resumed
    worker group is at its first iteration again, so it runs this no-op iteration first (grads zero, buffers
    restored, no optimizer step): the saved memories then meet the bucket layout they were saved with. The forward
    is the training step's own (``objective.loss`` through the DDP ``model``).
    """
    buffers = [b.detach().clone() for b in module.buffers()]
    loss = objective.loss(batch, model=model)
    (loss * 0.0).backward()  # type: ignore[no-untyped-call]
    for p in module.parameters():
        if p.requires_grad:
            p.grad = None
    with torch.no_grad():
        for b, old in zip(module.buffers(), buffers, strict=True):
            b.copy_(old)


def powersgd_state_dict(state: Any) -> dict[str, Any]:
    """PowerSGD's internal state as weights-only-loadable parts (its own pickling keeps a numpy RandomState)."""
    name, keys, pos, has_gauss, cached = state.rng.get_state(legacy=True)
    return {
        "iter": int(state.iter),
        "error_dict": {int(k): v.detach().cpu() for k, v in state.error_dict.items()},
        "p_memory_dict": {int(k): v.detach().cpu() for k, v in state.p_memory_dict.items()},
        "q_memory_dict": {int(k): v.detach().cpu() for k, v in state.q_memory_dict.items()},
        "rng": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
                "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
    }


def load_powersgd_state(state: Any, saved: Mapping[str, Any], device: torch.device) -> None:
    state.iter = int(saved["iter"])
    state.error_dict = {int(k): v.to(device) for k, v in saved["error_dict"].items()}
    state.p_memory_dict = {int(k): v.to(device) for k, v in saved["p_memory_dict"].items()}
    state.q_memory_dict = {int(k): v.to(device) for k, v in saved["q_memory_dict"].items()}
    rng = saved["rng"]
    state.rng.set_state((rng["name"], rng["keys"].numpy().astype(np.uint32), int(rng["pos"]),
                         int(rng["has_gauss"]), float(rng["cached"])))

