"""Models: the built-ins, any ``nn.Module`` from a factory, and Hugging Face causal LMs, used unchanged.

- ``builtin``: tiny_gpt, deep_mlp, rnn, linear (``forward((inputs, targets)) -> scalar loss``, ``blocks``);
- ``blocks``: finding a model's blocks, and freezing, activation checkpointing and the depth profile on them;
- ``hf``: ``hf_causal_lm`` (optional ``transformers``);
- ``build``: ``build_model`` and the contract check ``validate_model``.

How a batch becomes a loss is ``workers.objective.Objective``.
"""

from workers.models.blocks import (
    activation_checkpointing_enabled,
    attach_blocks,
    find_blocks,
    freeze_first_n_blocks,
    model_blocks,
    param_block_index,
    set_activation_checkpointing,
)
from workers.models.build import apply_distributed, build_model, validate_model
from workers.models.builtin import (
    BallastModel,
    CausalSelfAttention,
    DeepMLP,
    LinearRegression,
    MLPBlock,
    RecurrentLayer,
    RecurrentNet,
    TinyGPT,
    TransformerBlock,
)

__all__ = [
    "BallastModel", "CausalSelfAttention", "DeepMLP", "LinearRegression", "MLPBlock", "RecurrentLayer",
    "RecurrentNet", "TinyGPT", "TransformerBlock", "activation_checkpointing_enabled", "apply_distributed",
    "attach_blocks",
    "build_model", "find_blocks", "freeze_first_n_blocks", "model_blocks", "param_block_index",
    "set_activation_checkpointing", "validate_model",
]
