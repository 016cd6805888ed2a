"""LoRA adapters from the recipe (``distributed.lora``), through the optional ``peft`` package.

``peft.inject_adapter_in_model`` adapts the model in place (no ``PeftModel`` wrapper), so the trainer still holds
the user's module, whose blocks stay the same objects; only adapter parameters stay trainable. The checkpoint then
holds the adapted module's ``state_dict()`` (``...base_layer.weight`` beside ``...lora_A.default.weight``).
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

from contracts.recipe import LoRA
from workers.data import SpecError


def apply_lora(model: nn.Module, cfg: LoRA) -> list[str]:
    """Inject adapters into the layers ``cfg.target_modules`` names and freeze everything else; return the names of
    the trainable (adapter) parameters."""
    try:
        peft: Any = importlib.import_module("peft")
    except ImportError as exc:
        raise SpecError(f"distributed.lora: needs the optional 'peft' package (pip install 'ballast[lora]'): "
                        f"{exc}") from exc
    # the matching layers themselves (leaf modules: ``1`` names ``layers.0.1``, not the container ``layers.1``)
    targets = [name for name, module in model.named_modules()
               if any(name == t or name.endswith("." + t) for t in cfg.target_modules)
               and next(module.children(), None) is None]
    if not targets:
        raise SpecError(f"distributed.lora.target_modules: no layer of {type(model).__name__} is named "
                        f"{cfg.target_modules}")
    conv1d = any(type(model.get_submodule(t)).__name__ == "Conv1D" for t in targets)  # GPT-2's transposed linear
    config = peft.LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                             target_modules=targets, fan_in_fan_out=conv1d)
    try:
        peft.inject_adapter_in_model(config, model)
    except Exception as exc:
        raise SpecError(f"distributed.lora: peft could not adapt {type(model).__name__}: "
                        f"{type(exc).__name__}: {exc}") from exc
    trainable = []
    for name, p in model.named_parameters():
        adapter = "lora_" in name
        p.requires_grad_(adapter)
        if adapter:
            trainable.append(name)
    return trainable
