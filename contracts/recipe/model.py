"""The ``model:`` section: built-in models and user factories."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictBool, StrictFloat, StrictInt, Tag, model_validator

from contracts.recipe.base import Section, name_tag
from contracts.recipe.imports import ImportString


class NormPosition(StrEnum):
    pre = "pre"
    post = "post"


class TinyGPTModel(Section):
    """A small causal transformer: the standard subject of instability studies."""

    name: Literal["tiny_gpt"] = "tiny_gpt"
    vocab_size: StrictInt = Field(default=64, ge=2, le=65536)
    """Vocabulary size; must match the data's vocabulary."""
    context: StrictInt = Field(default=32, ge=2, le=8192)
    """Maximum sequence length."""
    n_layers: StrictInt = Field(default=2, ge=1, le=128)
    """Number of transformer blocks."""
    n_heads: StrictInt = Field(default=2, ge=1, le=128)
    """Attention heads per block; must divide d_model."""
    d_model: StrictInt = Field(default=64, ge=4, le=16384)
    """Residual stream width."""
    qk_layernorm: StrictBool = False
    """LayerNorm on queries and keys (stabilises attention logits)."""
    z_loss: StrictFloat = Field(default=0.0, ge=0.0, le=1.0)
    """Coefficient of the z-loss on the output logits' log-partition (0 = off)."""
    init_std: StrictFloat = Field(default=0.02, gt=0.0, le=10.0)
    """Standard deviation of the normal weight initialisation."""
    norm_position: NormPosition = NormPosition.pre
    """Pre-LN (stable) or post-LN (the original, less stable) blocks."""

    @model_validator(mode="after")
    def _heads_divide(self) -> TinyGPTModel:
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        return self


class Activation(StrEnum):
    relu = "relu"
    gelu = "gelu"
    tanh = "tanh"
    sigmoid = "sigmoid"


class DeepMLPModel(Section):
    """A deep multilayer perceptron: for vanishing and exploding gradients with depth."""

    name: Literal["deep_mlp"] = "deep_mlp"
    depth: StrictInt = Field(default=8, ge=1, le=512)
    """Number of hidden layers."""
    width: StrictInt = Field(default=64, ge=1, le=16384)
    """Hidden width."""
    activation: Activation = Activation.relu
    """Nonlinearity between layers."""
    residual: StrictBool = True
    """Residual connections around each hidden layer."""
    init_scale: StrictFloat = Field(default=1.0, gt=0.0, le=100.0)
    """Multiplier on the fan-in (Kaiming-style) initialisation; <1 shrinks, >1 grows signals with depth."""


class RecurrentCell(StrEnum):
    rnn = "rnn"
    gru = "gru"
    lstm = "lstm"


class RecurrentModel(Section):
    """A simple recurrent network over the sequence task."""

    name: Literal["rnn"] = "rnn"
    cell: RecurrentCell = RecurrentCell.rnn
    """Recurrent cell type (a plain tanh RNN is the easiest to blow up)."""
    hidden: StrictInt = Field(default=64, ge=1, le=8192)
    """Hidden state size."""
    layers: StrictInt = Field(default=1, ge=1, le=16)
    """Stacked recurrent layers."""
    recurrent_spectral_radius: float | None = Field(default=None, gt=0.0, le=100.0)
    """Initialise each recurrent (hidden-to-hidden) matrix as a random orthogonal matrix times this value, so every
    eigenvalue has this modulus (above 1: past the edge of chaos, exploding gradients); None: PyTorch's default."""


class LinearModel(Section):
    """Linear regression: the smallest model that diverges from optimizer settings alone."""

    name: Literal["linear"] = "linear"
    bias: StrictBool = True
    """Learn an intercept."""


_ATTRIBUTE_PATH = r"^[A-Za-z_]\w*(\.[A-Za-z_0-9]\w*)*$"


class CustomModel(Section):
    """Any ``torch.nn.Module`` from an import string; the module must be on the operator's allow-list.

    The model is used unchanged: ``forward(inputs)`` (with a ``loss:`` section), ``forward(**batch)`` for dict
    batches, or ``forward((inputs, targets)) -> scalar loss``. Its blocks (for freezing, activation checkpointing and
    the per-layer profile) are ``model.blocks`` if it has one, else the ``blocks`` attribute path below, else the
    longest ``nn.ModuleList`` of modules of one type."""

    name: Literal["custom"] = "custom"
    factory: ImportString
    """`module:function` returning a ``torch.nn.Module``; called with ``params`` as keyword arguments."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the factory."""
    blocks: str | None = Field(default=None, max_length=200, pattern=_ATTRIBUTE_PATH)
    """Attribute path of the model's repeated blocks (e.g. ``transformer.h``); None: found automatically."""


class HFCausalLMModel(Section):
    """A Hugging Face causal LM built from a config (random init, no download) or loaded from a local directory.

    Needs the optional ``transformers`` package (``pip install 'ballast[hf]'``). Its own loss is used (the batch's
    ``labels``); blocks are found automatically (``transformer.h`` for GPT-2)."""

    name: Literal["hf_causal_lm"] = "hf_causal_lm"
    config: dict[str, Any] = Field(default_factory=lambda: {"model_type": "gpt2"})
    """``AutoConfig.for_model(**config)``: ``model_type`` and its fields (e.g. gpt2: n_layer, n_embd, n_head,
    vocab_size, n_positions)."""
    pretrained_path: str | None = Field(default=None, min_length=1, max_length=4096)
    """A local directory with a saved model (``from_pretrained(path, local_files_only=True)``); None: from config."""
    blocks: str | None = Field(default=None, max_length=200, pattern=_ATTRIBUTE_PATH)
    """Attribute path of the repeated blocks; None: found automatically."""

    @model_validator(mode="after")
    def _model_type(self) -> HFCausalLMModel:
        if self.pretrained_path is None and not isinstance(self.config.get("model_type"), str):
            raise ValueError("config.model_type: required (a string such as 'gpt2') unless pretrained_path is set")
        return self


ModelSpec = Annotated[
    Annotated[TinyGPTModel, Tag("tiny_gpt")]
    | Annotated[DeepMLPModel, Tag("deep_mlp")]
    | Annotated[RecurrentModel, Tag("rnn")]
    | Annotated[LinearModel, Tag("linear")]
    | Annotated[CustomModel, Tag("custom")]
    | Annotated[HFCausalLMModel, Tag("hf_causal_lm")],
    Discriminator(
        name_tag("tiny_gpt"),
        custom_error_type="invalid_name",
        custom_error_message="unknown model name; expected one of: tiny_gpt, deep_mlp, rnn, linear, custom, "
        "hf_causal_lm",
    ),
]

BUILTIN_MODELS = ("tiny_gpt", "deep_mlp", "rnn", "linear")
"""Models whose ``forward((inputs, targets))`` returns their own loss (they take no ``loss:`` section)."""
