"""The ``data:`` section: built-in synthetic data with known loss floors, and user factories."""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictFloat, StrictInt, Tag

from contracts.recipe.base import Section, name_tag
from contracts.recipe.imports import ImportString


class MarkovData(Section):
    """A seeded synthetic language (a sparse Markov chain) with a known entropy floor."""

    name: Literal["markov"] = "markov"
    vocab_size: StrictInt = Field(default=64, ge=2, le=65536)
    """Number of distinct tokens."""
    seq_len: StrictInt = Field(default=32, ge=2, le=8192)
    """Tokens per training sequence (must not exceed the model's context)."""
    branching: StrictInt = Field(default=4, ge=1, le=1024)
    """Successors each token can be followed by; the entropy floor is about log(branching)."""
    seed: StrictInt = Field(default=1234, ge=0)
    """Seed of the language itself (transition table); the sample stream uses training.seed."""


class RegressionData(Section):
    """Noisy linear (or mildly nonlinear) regression data."""

    name: Literal["regression"] = "regression"
    dim: StrictInt = Field(default=32, ge=1, le=65536)
    """Input dimension."""
    noise: StrictFloat = Field(default=0.01, ge=0.0, le=100.0)
    """Standard deviation of the label noise."""
    condition: StrictFloat = Field(default=1.0, ge=1.0, le=1e6)
    """Condition number of the input covariance (large values make optimisation ill-conditioned)."""
    seed: StrictInt = Field(default=1234, ge=0)
    """Seed of the ground-truth function."""
    fixed_design: bool = False
    """Draw a fixed design matrix of num_samples rows once (from seed) and sample batches from its rows, so the
    full-batch loss and its Hessian are fixed and the stability limit 2/lambda_max is known (false: fresh inputs
    every batch)."""
    num_samples: int = Field(default=256, ge=1, le=1_000_000)
    """Rows of the fixed design matrix (fixed_design only); a batch_size equal to it is full-batch training."""


class SequenceTask(StrEnum):
    running_sum = "running_sum"
    copy = "copy"


class SequenceData(Section):
    """Sequence tasks for recurrent models."""

    name: Literal["sequence"] = "sequence"
    task: SequenceTask = SequenceTask.running_sum
    """What the model must predict at each position."""
    seq_len: StrictInt = Field(default=32, ge=2, le=8192)
    """Sequence length."""
    dim: StrictInt = Field(default=8, ge=1, le=4096)
    """Feature dimension per position."""
    seed: StrictInt = Field(default=1234, ge=0)
    """Seed of the task."""


class CustomData(Section):
    """User data from an import string; the module must be on the operator's allow-list."""

    name: Literal["custom"] = "custom"
    factory: ImportString
    """`module:function` called as ``factory(step_index, batch_size, seed, **params)`` returning a batch."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the factory."""


DataSpec = Annotated[
    Annotated[MarkovData, Tag("markov")]
    | Annotated[RegressionData, Tag("regression")]
    | Annotated[SequenceData, Tag("sequence")]
    | Annotated[CustomData, Tag("custom")],
    Discriminator(
        name_tag("markov"),
        custom_error_type="invalid_name",
        custom_error_message="unknown data name; expected one of: markov, regression, sequence, custom",
    ),
]

COMPATIBLE_DATA = {"tiny_gpt": {"markov"}, "deep_mlp": {"regression"}, "linear": {"regression"}, "rnn": {"sequence"}}
