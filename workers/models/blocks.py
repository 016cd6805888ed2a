"""A model's blocks, found without changing the model, and what works on them.

Blocks are the repeated layers in input → output order: freezing (``freeze_first_n_blocks``), activation
checkpointing (``set_activation_checkpointing``) and the per-layer depth profile (``param_block_index``) work on
them. They are found, in this order, as

1. ``model.blocks`` (a list, tuple or ``nn.ModuleList`` of the model's submodules): the built-ins, and any model
   that says so itself;
2. the recipe's attribute path (``model.blocks: transformer.h``): an ``nn.ModuleList`` or ``nn.Sequential``;
3. the longest ``nn.ModuleList`` whose children are all of one type (ties: the first in module order), e.g.
   GPT-2's ``transformer.h``.

A model with none still trains (no per-layer profile). The found blocks are remembered in the module's plain
``__dict__`` (never registered as submodules), so the model's ``state_dict()`` stays exactly its own, and
activation checkpointing replaces each block's ``forward`` by an instance attribute: no wrapper module, no key
prefix.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from workers.data import SpecError

_FOUND = "_ballast_blocks"
_HOW = "a `blocks` attribute on the model, or model.blocks: <attribute path> in the recipe"


def unwrap(model: nn.Module) -> nn.Module:
    """The user module under a DDP (or similar ``.module``) wrapper."""
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and _FOUND not in model.__dict__ and not hasattr(model, "blocks"):
        return inner
    return model


def _own_blocks(model: nn.Module, field: str) -> list[nn.Module] | None:
    blocks = getattr(model, "blocks", None)
    if blocks is None or isinstance(blocks, nn.Module) and not isinstance(blocks, nn.ModuleList | nn.Sequential):
        return None
    if not isinstance(blocks, nn.ModuleList | nn.Sequential | list | tuple) or len(blocks) == 0:
        raise SpecError(f"{field}: the model's `blocks` must be a non-empty list of its submodules (input → output "
                        f"order), got {type(blocks).__name__}")
    own = {id(m) for m in model.modules()}
    for i, block in enumerate(blocks):
        if not isinstance(block, nn.Module) or id(block) not in own:
            raise SpecError(f"{field}: blocks[{i}] must be a submodule of the model")
    return list(blocks)


def _path_blocks(model: nn.Module, path: str) -> list[nn.Module]:
    try:
        found = model.get_submodule(path)
    except AttributeError:
        raise SpecError(f"model.blocks: {type(model).__name__} has no submodule {path!r}") from None
    if not isinstance(found, nn.ModuleList | nn.Sequential) or len(found) == 0:
        raise SpecError(f"model.blocks: {path!r} is a {type(found).__name__}, not a non-empty ModuleList or "
                        "Sequential of blocks")
    return list(found)


def _longest_uniform_list(model: nn.Module) -> list[nn.Module]:
    best: list[nn.Module] = []
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            if len({type(child) for child in module}) == 1:
                best = list(module)
    return best


def find_blocks(model: nn.Module, path: str | None = None, *, field: str = "model.factory") -> list[nn.Module]:
    """The model's blocks by the rules in the module docstring ([] when none is found)."""
    own = _own_blocks(model, field)
    if own is not None:
        return own
    if path is not None:
        return _path_blocks(model, path)
    return _longest_uniform_list(model)


def attach_blocks(model: nn.Module, path: str | None = None, *, field: str = "model.factory") -> list[nn.Module]:
    """Find the blocks and remember them on ``model`` (outside its submodules and state dict)."""
    blocks = find_blocks(model, path, field=field)
    object.__setattr__(model, _FOUND, tuple(blocks))
    return blocks


def model_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks of ``model`` (looking through a DDP wrapper): the attached ones, else found now; [] if none."""
    inner = unwrap(model)
    found = inner.__dict__.get(_FOUND)
    if found is None:
        return attach_blocks(inner)
    return list(found)


def _no_blocks(field: str, model: nn.Module) -> SpecError:
    return SpecError(f"{field}: no blocks found in {type(unwrap(model)).__name__} (no `blocks` attribute, no "
                     f"ModuleList of one layer type); name them with {_HOW}")


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """A block's own forward, recomputed in the backward pass when training with gradients."""
    forward = type(self).forward
    if self.training and torch.is_grad_enabled():
        return checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
    return forward(self, *args, **kwargs)


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Recompute every block's activations in the backward pass (memory for compute; the same gradients).

    Each block's ``forward`` becomes a bound instance attribute that runs the class's forward under
    ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved), so it works for any model whose blocks were
    found, and the state dict is unchanged; turning it off removes the attribute again.
    """
    blocks = model_blocks(model)
    if enabled and not blocks:
        raise _no_blocks("distributed.activation_checkpointing", model)
    for block in blocks:
        if enabled:
            block.forward = types.MethodType(_checkpointed_forward, block)
        else:
            block.__dict__.pop("forward", None)


def activation_checkpointing_enabled(model: nn.Module) -> bool:
    blocks = model_blocks(model)
    return bool(blocks) and all("forward" in b.__dict__ for b in blocks)


def freeze_first_n_blocks(model: nn.Module, n: int) -> list[str]:
    """Set ``requires_grad=False`` on every parameter of ``blocks[:n]`` and return their names.

    Only blocks are frozen: embeddings, stems and heads stay trainable. Call it before wrapping in DDP (DDP
    registers only parameters that require grad) and before building the optimizer, which should receive only
    trainable parameters (a frozen parameter then never moves, even with weight decay).
    """
    blocks = model_blocks(model)
    if n > 0 and not blocks:
        raise _no_blocks("distributed.freeze_first_n_blocks", model)
    if n < 0 or n > len(blocks):
        raise SpecError(f"distributed.freeze_first_n_blocks: {n} is outside [0, {len(blocks)}] (the model's blocks)")
    frozen_ids = set()
    for block in blocks[:n]:
        for p in block.parameters():
            p.requires_grad_(False)
            frozen_ids.add(id(p))
    return [name for name, p in model.named_parameters() if id(p) in frozen_ids]


def param_block_index(model: nn.Module) -> dict[str, int]:
    """Parameter name → index of the block that owns it; parameters outside every block are left out ({} when the
    model has no blocks)."""
    owner: dict[int, int] = {}
    for i, block in enumerate(model_blocks(model)):
        for p in block.parameters():
            owner.setdefault(id(p), i)
    return {name: owner[id(p)] for name, p in model.named_parameters() if id(p) in owner}
