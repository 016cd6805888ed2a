"""The recipe's optimizer: built once per attempt, and its hyperparameters re-applied after a resume.

Weight decay skips what ``optimizer.no_decay`` names (by default every bias and every normalisation layer's
weights): two param groups, ``decay`` then ``no_decay`` (``"no_decay": True`` in the group), each in the order of
the parameters given, so the layout, and with it a checkpoint's optimizer state, is the same on every build. The
clipper and the grad norms keep using the trainable parameters in model order; only the optimizer groups them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from contracts.recipe import NoDecay, Optimizer, OptimizerName

NORM_LAYERS: tuple[type[nn.Module], ...] = (
    nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase, nn.RMSNorm,
)
"""Module types whose parameters count as ``norm`` (BatchNorm and InstanceNorm share ``_NormBase``)."""


def _is_norm(module: nn.Module) -> bool:
    # Hugging Face and other libraries define their own RMSNorm/LayerNorm classes: go by the class name too
    return isinstance(module, NORM_LAYERS) or type(module).__name__.lower().endswith(("norm", "layernorm"))


def no_decay_names(model: nn.Module, kinds: Sequence[NoDecay]) -> set[str]:
    """Names of ``model``'s parameters kept out of weight decay by ``kinds``."""
    wanted = set(kinds)
    out: set[str] = set()
    for mod_name, module in model.named_modules():
        prefix = f"{mod_name}." if mod_name else ""
        for p_name, _ in module.named_parameters(recurse=False):
            full = prefix + p_name
            if NoDecay.bias in wanted and p_name == "bias":
                out.add(full)
            elif NoDecay.norm in wanted and _is_norm(module):
                out.add(full)
            elif NoDecay.embedding in wanted and isinstance(module, nn.Embedding):
                out.add(full)
    return out


def param_groups(named_params: Sequence[tuple[str, nn.Parameter]], cfg: Optimizer,
                 model: nn.Module | None = None) -> list[dict[str, Any]]:
    """``[decay, no_decay]`` groups over ``named_params`` (names as ``model.named_parameters()``); one group of
    everything when ``no_decay`` is empty or no model is given (the layout before groups existed)."""
    if model is None or not cfg.no_decay:
        return [{"params": [p for _, p in named_params]}]
    skip = no_decay_names(model, cfg.no_decay)
    decay = [p for n, p in named_params if n not in skip]
    keep = [p for n, p in named_params if n in skip]
    return [{"params": decay}, {"params": keep, "weight_decay": 0.0, "no_decay": True}]


def build_optimizer(params: Sequence[nn.Parameter] | Sequence[tuple[str, nn.Parameter]], cfg: Optimizer,
                    model: nn.Module | None = None) -> torch.optim.Optimizer:
    """SGD (momentum, nesterov only with momentum), AdamW or Adam at ``cfg.lr``.

    Given ``(name, param)`` pairs and the ``model`` they belong to, the params are grouped by ``param_groups``;
    plain params (or no model) give one group with weight decay on everything."""
    named = [item if isinstance(item, tuple) else (str(i), item) for i, item in enumerate(params)]
    groups = param_groups(named, cfg, model if all(isinstance(i, tuple) for i in params) else None)
    if cfg.name is OptimizerName.sgd:
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0,
                               weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if cfg.name is OptimizerName.adamw else torch.optim.Adam
    return cls(groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def hyperparameters(cfg: Optimizer) -> dict[str, Any]:
    """The param-group settings the recipe owns (all but the LR, which the schedule sets every step): on a resume
    they overwrite the checkpoint's, so an overridden recipe wins (``apply_hyperparameters`` keeps the no-decay
    group at zero)."""
    if cfg.name is OptimizerName.sgd:
        return {"momentum": cfg.momentum, "nesterov": cfg.nesterov and cfg.momentum > 0,
                "weight_decay": cfg.weight_decay}
    return {"betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}


def apply_hyperparameters(optimizer: torch.optim.Optimizer, hyper: dict[str, Any]) -> None:
    """Set ``hyper`` on every param group; a ``no_decay`` group keeps weight decay 0."""
    for group in optimizer.param_groups:
        group.update(hyper)
        if group.get("no_decay"):
            group["weight_decay"] = 0.0


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any],
                         params: Sequence[nn.Parameter]) -> None:
    """``optimizer.load_state_dict(saved)``; a one-group state saved before param groups existed (its indices are
    positions in ``params``, the trainable parameters in model order) is regrouped to this optimizer's layout."""
    groups = saved["param_groups"]
    if len(groups) == 1 and len(optimizer.param_groups) > 1:
        position = {id(p): i for i, p in enumerate(params)}
        state: dict[int, Any] = {}
        new_groups = []
        k = 0
        for group in optimizer.param_groups:
            indices = []
            for p in group["params"]:
                old = position[id(p)]
                if old in saved["state"]:
                    state[k] = saved["state"][old]
                indices.append(k)
                k += 1
            hyper = {key: v for key, v in groups[0].items() if key != "params"}
            new_groups.append({**hyper, **{key: group[key] for key in ("weight_decay", "no_decay") if key in group},
                               "params": indices})
        saved = {"state": state, "param_groups": new_groups}
    optimizer.load_state_dict(saved)
