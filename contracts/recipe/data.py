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


class DatasetData(Section):
    """A ``torch.utils.data.Dataset`` (map-style) from an import string; the module must be on the allow-list.

    Batches come from a seeded, resumable sampler: batch ``index`` of a rank is a pure function of (training.seed,
    rank, world size, index), each epoch a fresh permutation, so a resume or a skipped data window replays exactly.
    Items are collated with ``torch.utils.data.default_collate``: ``(inputs, targets)`` pairs give tuple batches,
    dicts give dict batches (passed to the model as keyword arguments)."""

    name: Literal["dataset"] = "dataset"
    factory: ImportString
    """`module:function` returning the training ``Dataset``; called with ``params`` as keyword arguments."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the factory (and for ``eval_factory``)."""
    eval_factory: ImportString | None = None
    """`module:function` returning the held-out ``Dataset``; None: hold out ``eval_fraction`` of the training one."""
    eval_fraction: StrictFloat = Field(default=0.1, ge=0.0, le=0.5)
    """Without ``eval_factory``: the fraction of items (a seeded random split) held out for evaluation."""
    shuffle: bool = True
    """A new seeded permutation every epoch (false: dataset order, epoch after epoch)."""


class TokenDType(StrEnum):
    uint16 = "uint16"
    int32 = "int32"


class TokensFileData(Section):
    """Language-model data from a local file, in windows of ``seq_len`` tokens: dict batches ``{input_ids,
    attention_mask, labels}`` (labels = input_ids; the model shifts them) from the same seeded sampler as
    ``dataset``. The last ``eval_fraction`` of the windows is held out."""

    name: Literal["tokens_file"] = "tokens_file"
    path: str = Field(min_length=1, max_length=4096)
    """A token file (``.npy``, ``.pt`` tensor, or raw ``.bin`` of ``dtype``), or a text file with ``tokenizer_path``."""
    seq_len: StrictInt = Field(default=64, ge=2, le=131072)
    """Tokens per sequence (must not exceed the model's positions)."""
    tokenizer_path: str | None = Field(default=None, min_length=1, max_length=4096)
    """A local tokenizer directory (``AutoTokenizer.from_pretrained(path, local_files_only=True)``): ``path`` is
    then text, tokenized once."""
    dtype: TokenDType = TokenDType.uint16
    """Element type of a raw ``.bin`` file."""
    eval_fraction: StrictFloat = Field(default=0.1, ge=0.0, le=0.5)
    """Fraction of the windows (the file's tail) held out for evaluation."""
    shuffle: bool = True
    """A new seeded permutation of the windows every epoch."""


DataSpec = Annotated[
    Annotated[MarkovData, Tag("markov")]
    | Annotated[RegressionData, Tag("regression")]
    | Annotated[SequenceData, Tag("sequence")]
    | Annotated[CustomData, Tag("custom")]
    | Annotated[DatasetData, Tag("dataset")]
    | Annotated[TokensFileData, Tag("tokens_file")],
    Discriminator(
        name_tag("markov"),
        custom_error_type="invalid_name",
        custom_error_message="unknown data name; expected one of: markov, regression, sequence, custom, dataset, "
        "tokens_file",
    ),
]

COMPATIBLE_DATA = {"tiny_gpt": {"markov"}, "deep_mlp": {"regression"}, "linear": {"regression"}, "rnn": {"sequence"},
                   "hf_causal_lm": {"tokens_file"}}
"""Built-in pairings; user data (``custom``, ``dataset``) goes with any model (its batches are checked when built)."""
USER_DATA = frozenset({"custom", "dataset"})
