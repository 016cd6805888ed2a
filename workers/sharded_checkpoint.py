"""Sharded checkpoints (``distributed.strategy: fsdp``): every rank writes its own shards of the model and the
optimizer through ``torch.distributed.checkpoint`` (DCP); a load reshards to whatever world size reads it.

Layout: the ordinary checkpoint directory (``contracts/checkpoint.py``) with the ``model`` and ``optimizer`` parts
moved out of their ``.pt`` files into a DCP directory beside them::

    step_00000050/
        manifest.json      lists every file below with its sha256, the shards too; meta.shards says where they are
        shards/.metadata   DCP's index of the tensors (written by rank 0)
        shards/__0_0.distcp, shards/__1_0.distcp, ...   one file per rank
        scaler.pt, detectors.pt, clipper.pt, rng.pt, comm_hook.pt, progress.pt, ...   rank 0, as in every checkpoint

The shards hold ``get_state_dict(model, optimizer)`` (``torch.distributed.checkpoint.state_dict``): parameter
names as keys, the optimizer's state keyed by parameter name, so any sharding (or none) of the same model reads it.

Writing (``stage_shards``, a collective): rank 0 picks a hidden staging directory, every rank ``dcp.save``-s its
shards into it; rank 0's ordinary atomic write (``save_checkpoint(..., attach=...)``) then moves it into the new
checkpoint, hashes its files into the manifest and renames the whole directory into place. So a sharded
checkpoint is verified, retained, listed and deleted by exactly the code that handles the others, and a crash
leaves either a complete checkpoint or only a hidden directory. The staging directory must be visible to every
rank: the checkpoint directory in a plain process; under Ray Train the node's temporary directory, so a sharded
run under Ray Train must keep its ranks on one node (``comm.check_backend`` refuses otherwise).

Reading (``load_shards``): verify the shard files against the manifest, then ``dcp.load`` into this process's
own ``get_state_dict`` (sharded under FSDP, full tensors in a plain module at world size 1, with or without a
process group) and ``set_state_dict`` it. ``full_parts`` turns the shards into ordinary full state dicts without
any process group or model (``dcp_to_torch_save``), for ``ballast export``.
"""

from __future__ import annotations

import contextlib
import tempfile
import uuid
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from contracts.checkpoint import CorruptCheckpoint, Manifest, verify_files
from workers.context import WorkerContext, broadcast_object

SHARDS = "shards"
"""The subdirectory of a sharded checkpoint that holds the DCP files."""
SHARDED_PARTS = ("model", "optimizer")
"""The parts of the training state that live in the shards instead of ``.pt`` files."""


def shards_of(manifest: Manifest) -> dict[str, Any] | None:
    """``meta.shards`` of a sharded checkpoint (``{"dir", "parts", "world_size"}``), None for a full one."""
    info = manifest.meta.get("shards")
    return dict(info) if isinstance(info, Mapping) else None


def shards_meta(world_size: int) -> dict[str, Any]:
    return {"dir": SHARDS, "parts": list(SHARDED_PARTS), "world_size": world_size}


def without_sharded_parts(parts: Mapping[str, Any]) -> dict[str, Any]:
    """The checkpoint's ``.pt`` parts of a sharded checkpoint: everything but the model and the optimizer."""
    return {k: v for k, v in parts.items() if k not in SHARDED_PARTS}


def _dcp_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    return {"model": model_sd, "optimizer": optim_sd}


@contextlib.contextmanager
def _single_process_quietly() -> Iterator[None]:
    """DCP warns on every save/load without a process group that it assumes a single process: it is meant."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def staging_root(ctx: WorkerContext, checkpoint_dir: str | Path) -> Path:
    """Where the shards are staged: beside the checkpoints in a plain process, the node's tmp under Ray Train."""
    return Path(tempfile.gettempdir()) if ctx.ray_train else Path(checkpoint_dir)


def stage_shards(module: nn.Module, optimizer: torch.optim.Optimizer, ctx: WorkerContext,
                 root: str | Path) -> Path:
    """Every rank writes its shards of the model and optimizer into one new hidden directory under ``root`` (a
    collective: every rank calls it) → that directory, complete on every rank when this returns."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.state_dict_saver import save

    name = broadcast_object(f".shards-{uuid.uuid4().hex[:12]}" if ctx.is_main else None, ctx)
    staging = Path(root) / str(name)
    staging.mkdir(parents=True, exist_ok=True)
    with _single_process_quietly():
        save(_dcp_state(module, optimizer), storage_writer=FileSystemWriter(str(staging), sync_files=True))
    return staging


def _shard_files(manifest: Manifest, info: Mapping[str, Any]) -> list[str]:
    prefix = f"{info.get('dir', SHARDS)}/"
    return sorted(n for n in manifest.files if n.startswith(prefix))


def load_shards(directory: str | Path, manifest: Manifest, module: nn.Module,
                optimizer: torch.optim.Optimizer) -> None:
    """Restore the model and optimizer of a sharded checkpoint into ``module``/``optimizer`` at this process's
    world size (a collective under a process group). The shard files are verified against the manifest first."""
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load

    info = shards_of(manifest)
    if info is None:
        raise CorruptCheckpoint(directory, "not a sharded checkpoint (its manifest has no meta.shards)")
    names = _shard_files(manifest, info)
    if not names:
        raise CorruptCheckpoint(directory, f"{info.get('dir')}/: the manifest lists no shard files")
    verify_files(Path(directory), manifest, names)
    state = _dcp_state(module, optimizer)
    with _single_process_quietly():
        load(state, storage_reader=FileSystemReader(str(Path(directory) / str(info["dir"]))))
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])


def full_parts(directory: str | Path, manifest: Manifest, parts: Sequence[str] = ("model",)) -> dict[str, Any]:
    """The named parts of a sharded checkpoint as full (unsharded) state dicts, read without any process group
    or model (DCP's ``dcp_to_torch_save``, then a weights-only load). Verifies the shard files first."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    info = shards_of(manifest)
    if info is None:
        raise CorruptCheckpoint(directory, "not a sharded checkpoint (its manifest has no meta.shards)")
    verify_files(Path(directory), manifest, _shard_files(manifest, info))
    with tempfile.TemporaryDirectory(prefix="ballast-shards-") as tmp:
        target = Path(tmp) / "full.pt"
        with _single_process_quietly():
            dcp_to_torch_save(str(Path(directory) / str(info["dir"])), str(target))
        full = torch.load(target, map_location="cpu", weights_only=True)
    missing = [p for p in parts if p not in full]
    if missing:
        raise CorruptCheckpoint(directory, f"its shards hold no part(s) {missing}")
    return {p: full[p] for p in parts}
