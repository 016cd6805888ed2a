"""Hugging Face models: ``model: {name: hf_causal_lm, config: {...}, pretrained_path: null}``.

``transformers`` is an optional extra (``pip install 'ballast[hf]'``); without it a recipe that needs it is a
SpecError naming the field. Nothing is ever downloaded: a model is built from its config (random init, under the
recipe's seed) or loaded from a local directory with ``local_files_only=True``.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

from torch import nn

from contracts.recipe import CrossEntropyLoss, HFCausalLMModel, LossSpec
from workers.data import DataDims, SpecError


def require_transformers(field: str) -> ModuleType:
    """The ``transformers`` module, or a SpecError saying how to install it."""
    try:
        return importlib.import_module("transformers")
    except ImportError as exc:
        raise SpecError(f"{field}: needs the optional 'transformers' package (pip install 'ballast[hf]'): "
                        f"{exc}") from exc


def build_hf_causal_lm(spec: HFCausalLMModel) -> nn.Module:
    """``AutoModelForCausalLM.from_config(AutoConfig.for_model(**config))``, or ``from_pretrained(path,
    local_files_only=True)`` with ``pretrained_path``."""
    tf = require_transformers("model.name")
    if spec.pretrained_path is not None:
        try:
            model = tf.AutoModelForCausalLM.from_pretrained(spec.pretrained_path, local_files_only=True)
        except Exception as exc:
            raise SpecError(f"model.pretrained_path: cannot load a causal LM from {spec.pretrained_path}: "
                            f"{type(exc).__name__}: {exc}") from exc
    else:
        try:
            config = tf.AutoConfig.for_model(**spec.config)
            model = tf.AutoModelForCausalLM.from_config(config)
        except Exception as exc:
            raise SpecError(f"model.config: cannot build a causal LM from {spec.config}: "
                            f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise SpecError(f"model.name: transformers returned a {type(model).__name__}, not a torch module")
    return model


def causal_lm_loss_spec(model: nn.Module) -> LossSpec | None:
    """A Hugging Face causal LM's own loss as a ``loss:`` section would name it: cross-entropy over its labels
    (it shifts them one position first, which leaves their frequencies all but unchanged); None for any other
    model. The verdict's trivial loss on a token file is measured under it."""
    tf = sys.modules.get("transformers")  # a Hugging Face model means transformers is imported already
    if tf is None:
        return None
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    names = {n for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for n in ((v,) if isinstance(v, str) else v)}
    # by class, and through the subclass FSDP2's fully_shard swaps in (FSDPGPT2LMHeadModel)
    causal = isinstance(model, tf.PreTrainedModel) and any(c.__name__ in names for c in type(model).__mro__)
    return CrossEntropyLoss() if causal else None


def check_hf_data(model: nn.Module, data: DataDims | None) -> None:
    """The data's vocabulary and sequence length must fit the model's config."""
    config: Any = getattr(model, "config", None)
    if data is None or config is None:
        return
    vocab = getattr(config, "vocab_size", None)
    if data.vocab_size is not None and isinstance(vocab, int) and data.vocab_size > vocab:
        raise SpecError(f"data.vocab_size: the data's token ids reach {data.vocab_size - 1}, beyond the model's "
                        f"vocab_size ({vocab})")
    positions = getattr(config, "max_position_embeddings", None)
    if data.seq_len is not None and isinstance(positions, int) and data.seq_len > positions:
        raise SpecError(f"data.seq_len: {data.seq_len} exceeds the model's max_position_embeddings ({positions})")
