"""The recipe's optimizer: built once per attempt, and its hyperparameters re-applied after a resume."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from contracts.recipe import Optimizer, OptimizerName


def build_optimizer(params: Sequence[nn.Parameter], cfg: Optimizer) -> torch.optim.Optimizer:
    """SGD (momentum, nesterov only with momentum), AdamW or Adam over ``params`` at ``cfg.lr``."""
    if cfg.name is OptimizerName.sgd:
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov and cfg.momentum > 0,
                               weight_decay=cfg.weight_decay)
    cls = torch.optim.AdamW if cfg.name is OptimizerName.adamw else torch.optim.Adam
    return cls(params, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)


def hyperparameters(cfg: Optimizer) -> dict[str, Any]:
    """The param-group settings the recipe owns (all but the LR, which the schedule sets every step): on a resume
    they overwrite the checkpoint's, so an overridden recipe wins."""
    if cfg.name is OptimizerName.sgd:
        return {"momentum": cfg.momentum, "nesterov": cfg.nesterov and cfg.momentum > 0,
                "weight_decay": cfg.weight_decay}
    return {"betas": cfg.betas, "eps": cfg.eps, "weight_decay": cfg.weight_decay}
