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


class CustomModel(Section):
    """A user model from an import string; the module must be on the operator's allow-list."""

    name: Literal["custom"] = "custom"
    factory: ImportString
    """`module:function` returning a ``torch.nn.Module``; called with ``params`` as keyword arguments."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the factory."""


ModelSpec = Annotated[
    Annotated[TinyGPTModel, Tag("tiny_gpt")]
    | Annotated[DeepMLPModel, Tag("deep_mlp")]
    | Annotated[RecurrentModel, Tag("rnn")]
    | Annotated[LinearModel, Tag("linear")]
    | Annotated[CustomModel, Tag("custom")],
    Discriminator(
        name_tag("tiny_gpt"),
        custom_error_type="invalid_name",
        custom_error_message="unknown model name; expected one of: tiny_gpt, deep_mlp, rnn, linear, custom",
    ),
]
