"""The stability recipe: a versioned, self-documenting schema for one training run.

Every section is a pydantic model with ``extra="forbid"``; the docstring under each field is its description
(and shows up in the JSON Schema that editors use). ``load_recipe`` is the only way text becomes a ``Recipe``:
it enforces a size limit before parsing, refuses YAML aliases and duplicate keys, and reports every error with
its field path and, where known, its line.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

API_VERSION: Literal["ballast/v1"] = "ballast/v1"
KIND: Literal["StabilityRecipe"] = "StabilityRecipe"
DEFAULT_MAX_RECIPE_BYTES = 256 * 1024
_IMPORT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, populate_by_name=True, allow_inf_nan=False
    )


# --------------------------------------------------------------------------------------------------- model
class NormPosition(StrEnum):
    pre = "pre"
    post = "post"


class TinyGPTModel(_Section):
    """A small causal transformer: the standard subject of instability studies."""

    name: Literal["tiny_gpt"] = "tiny_gpt"
    vocab_size: int = Field(default=64, ge=2, le=65536)
    """Vocabulary size; must match the data's vocabulary."""
    context: int = Field(default=32, ge=2, le=8192)
    """Maximum sequence length."""
    n_layers: int = Field(default=2, ge=1, le=128)
    """Number of transformer blocks."""
    n_heads: int = Field(default=2, ge=1, le=128)
    """Attention heads per block; must divide d_model."""
    d_model: int = Field(default=64, ge=4, le=16384)
    """Residual stream width."""
    qk_layernorm: bool = False
    """LayerNorm on queries and keys (stabilises attention logits)."""
    z_loss: float = Field(default=0.0, ge=0.0, le=1.0)
    """Coefficient of the z-loss on the output logits' log-partition (0 = off)."""
    init_std: float = Field(default=0.02, gt=0.0, le=10.0)
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


class DeepMLPModel(_Section):
    """A deep multilayer perceptron: for vanishing and exploding gradients with depth."""

    name: Literal["deep_mlp"] = "deep_mlp"
    depth: int = Field(default=8, ge=1, le=512)
    """Number of hidden layers."""
    width: int = Field(default=64, ge=1, le=16384)
    """Hidden width."""
    activation: Activation = Activation.relu
    """Nonlinearity between layers."""
    residual: bool = True
    """Residual connections around each hidden layer."""
    init_scale: float = Field(default=1.0, gt=0.0, le=100.0)
    """Multiplier on the fan-in (Kaiming-style) initialisation; <1 shrinks, >1 grows signals with depth."""


class RecurrentCell(StrEnum):
    rnn = "rnn"
    gru = "gru"
    lstm = "lstm"


class RecurrentModel(_Section):
    """A simple recurrent network over the sequence task."""

    name: Literal["rnn"] = "rnn"
    cell: RecurrentCell = RecurrentCell.rnn
    """Recurrent cell type (a plain tanh RNN is the easiest to blow up)."""
    hidden: int = Field(default=64, ge=1, le=8192)
    """Hidden state size."""
    layers: int = Field(default=1, ge=1, le=16)
    """Stacked recurrent layers."""


class LinearModel(_Section):
    """Linear regression: the smallest model that diverges from optimizer settings alone."""

    name: Literal["linear"] = "linear"
    bias: bool = True
    """Learn an intercept."""


class CustomModel(_Section):
    """A user model from an import string; the module must be on the operator's allow-list."""

    name: Literal["custom"] = "custom"
    factory: str
    """`module:function` returning a ``torch.nn.Module``; called with ``params`` as keyword arguments."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the factory."""

    @field_validator("factory")
    @classmethod
    def _check_import(cls, v: str, info: ValidationInfo) -> str:
        return _check_import_string(v, info)


_MODEL_NAMES = ("tiny_gpt", "deep_mlp", "rnn", "linear", "custom")
_DATA_NAMES = ("markov", "regression", "sequence", "custom")


def _name_tag(default: str) -> Callable[[Any], str | None]:
    """Discriminate on ``name``, defaulting to ``default`` when the section omits it."""

    def tag(value: Any) -> str | None:
        if isinstance(value, dict):
            name = value.get("name", default)
            return name if isinstance(name, str) else None
        return getattr(value, "name", None)

    return tag


ModelSpec = Annotated[
    Annotated[TinyGPTModel, Tag("tiny_gpt")]
    | Annotated[DeepMLPModel, Tag("deep_mlp")]
    | Annotated[RecurrentModel, Tag("rnn")]
    | Annotated[LinearModel, Tag("linear")]
    | Annotated[CustomModel, Tag("custom")],
    Discriminator(
        _name_tag("tiny_gpt"),
        custom_error_type="invalid_name",
        custom_error_message="unknown model name; expected one of: tiny_gpt, deep_mlp, rnn, linear, custom",
    ),
]


# ---------------------------------------------------------------------------------------------------- data
class MarkovData(_Section):
    """A seeded synthetic language (a sparse Markov chain) with a known entropy floor."""

    name: Literal["markov"] = "markov"
    vocab_size: int = Field(default=64, ge=2, le=65536)
    """Number of distinct tokens."""
    seq_len: int = Field(default=32, ge=2, le=8192)
    """Tokens per training sequence (must not exceed the model's context)."""
    branching: int = Field(default=4, ge=1, le=1024)
    """Successors each token can be followed by; the entropy floor is about log(branching)."""
    seed: int = Field(default=1234, ge=0)
    """Seed of the language itself (transition table); the sample stream uses training.seed."""


class RegressionData(_Section):
    """Noisy linear (or mildly nonlinear) regression data."""

    name: Literal["regression"] = "regression"
    dim: int = Field(default=32, ge=1, le=65536)
    """Input dimension."""
    noise: float = Field(default=0.01, ge=0.0, le=100.0)
    """Standard deviation of the label noise."""
    condition: float = Field(default=1.0, ge=1.0, le=1e6)
    """Condition number of the input covariance (large values make optimisation ill-conditioned)."""
    seed: int = Field(default=1234, ge=0)
    """Seed of the ground-truth function."""


class SequenceTask(StrEnum):
    running_sum = "running_sum"
    copy = "copy"


class SequenceData(_Section):
    """Sequence tasks for recurrent models."""

    name: Literal["sequence"] = "sequence"
    task: SequenceTask = SequenceTask.running_sum
    """What the model must predict at each position."""
    seq_len: int = Field(default=32, ge=2, le=8192)
    """Sequence length."""
    dim: int = Field(default=8, ge=1, le=4096)
    """Feature dimension per position."""
    seed: int = Field(default=1234, ge=0)
    """Seed of the task."""


class CustomData(_Section):
    """User data from an import string; the module must be on the operator's allow-list."""

    name: Literal["custom"] = "custom"
    factory: str
    """`module:function` called as ``factory(step_index, batch_size, seed, **params)`` returning a batch."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the factory."""

    @field_validator("factory")
    @classmethod
    def _check_import(cls, v: str, info: ValidationInfo) -> str:
        return _check_import_string(v, info)


DataSpec = Annotated[
    Annotated[MarkovData, Tag("markov")]
    | Annotated[RegressionData, Tag("regression")]
    | Annotated[SequenceData, Tag("sequence")]
    | Annotated[CustomData, Tag("custom")],
    Discriminator(
        _name_tag("markov"),
        custom_error_type="invalid_name",
        custom_error_message="unknown data name; expected one of: markov, regression, sequence, custom",
    ),
]

_COMPATIBLE_DATA = {"tiny_gpt": {"markov"}, "deep_mlp": {"regression"}, "linear": {"regression"}, "rnn": {"sequence"}}


# ------------------------------------------------------------------------------------------------ training
class Training(_Section):
    max_steps: int = Field(default=200, ge=1, le=10_000_000)
    """Optimizer steps to train for."""
    batch_size: int = Field(default=16, ge=1, le=1_000_000)
    """Micro-batch size per worker."""
    grad_accum_steps: int = Field(default=1, ge=1, le=4096)
    """Micro-batches accumulated per optimizer step."""
    seed: int = Field(default=0, ge=0)
    """Seed for initialisation and the data stream."""
    eval_interval: int = Field(default=0, ge=0)
    """Evaluate on held-out batches every N steps (0 = never)."""
    deterministic: bool = False
    """Use deterministic algorithms (for resume-equivalence checks; slower)."""


# ----------------------------------------------------------------------------------------------- optimizer
class OptimizerName(StrEnum):
    adamw = "adamw"
    adam = "adam"
    sgd = "sgd"


class Optimizer(_Section):
    name: OptimizerName = OptimizerName.adamw
    """Optimizer family."""
    lr: float = Field(default=1e-3, gt=0.0, le=100.0)
    """Peak learning rate."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas (beta1, beta2), each in [0, 1)."""
    eps: float = Field(default=1e-8, gt=0.0, le=1.0)
    """Adam epsilon."""
    weight_decay: float = Field(default=0.0, ge=0.0, le=10.0)
    """Decoupled (AdamW) or L2 (Adam, SGD) weight decay."""
    momentum: float = Field(default=0.9, ge=0.0, lt=1.0)
    """SGD momentum."""
    nesterov: bool = False
    """SGD Nesterov momentum."""

    @field_validator("betas")
    @classmethod
    def _betas_range(cls, v: tuple[float, float]) -> tuple[float, float]:
        for i, b in enumerate(v):
            if not 0.0 <= b < 1.0:
                raise ValueError(f"betas[{i}] must be in [0, 1), got {b}")
        return v

    @property
    def is_adam_family(self) -> bool:
        return self.name in (OptimizerName.adam, OptimizerName.adamw)


# ------------------------------------------------------------------------------------------------ schedule
class Decay(StrEnum):
    cosine = "cosine"
    linear = "linear"
    constant = "constant"


class SchedulePreset(StrEnum):
    pretrain = "pretrain"
    sft = "sft"
    rlhf = "rlhf"


SCHEDULE_PRESETS: dict[str, dict[str, Any]] = {
    "pretrain": {"warmup_fraction": 0.05, "decay": "cosine", "min_lr_ratio": 0.1},
    "sft": {"warmup_fraction": 0.03, "decay": "linear", "min_lr_ratio": 0.0},
    "rlhf": {"warmup_fraction": 0.1, "decay": "constant", "min_lr_ratio": 1.0},
}


class Schedule(_Section):
    preset: SchedulePreset | None = None
    """Named defaults (pretrain, sft, rlhf) for the fields left unset."""
    warmup_steps: int | None = Field(default=None, ge=0)
    """Linear warmup length in steps (exclusive with warmup_fraction)."""
    warmup_fraction: float | None = Field(default=None, ge=0.0, lt=1.0)
    """Linear warmup length as a fraction of training.max_steps."""
    decay: Decay = Decay.cosine
    """Shape of the decay after warmup."""
    min_lr_ratio: float = Field(default=0.1, ge=0.0, le=1.0)
    """Final LR as a fraction of the peak."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("preset"), str) and data["preset"] in SCHEDULE_PRESETS:
            defaults = dict(SCHEDULE_PRESETS[data["preset"]])
            if "warmup_steps" in data and data["warmup_steps"] is not None:
                defaults.pop("warmup_fraction")
            return {**defaults, **data}
        return data

    @model_validator(mode="after")
    def _one_warmup(self) -> Schedule:
        if self.warmup_steps is not None and self.warmup_fraction is not None:
            raise ValueError("set warmup_steps or warmup_fraction, not both")
        return self

    def resolved_warmup_steps(self, max_steps: int) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        if self.warmup_fraction is not None:
            return int(self.warmup_fraction * max_steps)
        return 0


# ----------------------------------------------------------------------------------------------- precision
class DType(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class LossScaling(StrEnum):
    dynamic = "dynamic"
    static = "static"
    none = "none"


class Precision(_Section):
    dtype: DType = DType.fp32
    """Autocast compute dtype (master weights stay fp32)."""
    loss_scaling: LossScaling = LossScaling.dynamic
    """Loss scaling mode; used only with fp16."""
    init_scale: float = Field(default=2.0**16, gt=0.0, le=2.0**32)
    """Initial dynamic loss scale."""
    growth_factor: float = Field(default=2.0, gt=1.0, le=100.0)
    """Scale multiplier after growth_interval overflow-free steps."""
    backoff_factor: float = Field(default=0.5, gt=0.0, lt=1.0)
    """Scale multiplier on an overflow step."""
    growth_interval: int = Field(default=2000, ge=1)
    """Overflow-free steps before the scale grows."""
    static_scale: float = Field(default=1024.0, gt=0.0, le=2.0**32)
    """The fixed scale used when loss_scaling is static."""


# ------------------------------------------------------------------------------------------------ clipping
class ClipMethod(StrEnum):
    none = "none"
    global_norm = "global_norm"
    per_layer = "per_layer"
    adaptive = "adaptive"
    zscore = "zscore"


class Clipping(_Section):
    method: ClipMethod = ClipMethod.global_norm
    """none, global_norm, per_layer (each parameter tensor to max_norm), adaptive (AGC), zscore (EMA)."""
    max_norm: float = Field(default=1.0, gt=0.0, le=1e6)
    """Norm threshold for global_norm and per_layer; the ceiling for zscore."""
    agc_lambda: float = Field(default=0.01, gt=0.0, le=10.0)
    """AGC: largest allowed unit-wise ratio of gradient norm to weight norm."""
    agc_eps: float = Field(default=1e-3, gt=0.0, le=1.0)
    """AGC: floor on the weight norm, so zero-initialised units can still move."""
    zscore_alpha: float = Field(default=0.02, gt=0.0, lt=1.0)
    """Z-score clipping: EMA coefficient of the grad-norm mean and variance."""
    zscore_threshold: float = Field(default=3.0, gt=0.0, le=100.0)
    """Z-score clipping: norms above mean + z * std are clipped to that bound."""
    zscore_warmup: int = Field(default=20, ge=0)
    """Z-score clipping: steps of plain global-norm clipping while the EMA settles."""


# ----------------------------------------------------------------------------------------------- detectors
class Action(StrEnum):
    record = "record"
    skip_step = "skip_step"
    rollback = "rollback"


class NonFiniteDetector(_Section):
    enabled: bool = True
    """Check loss and gradients for NaN/Inf before optimizer.step()."""
    action: Action = Action.rollback
    """What to do on a non-finite loss or gradient (outside fp16 overflow handling)."""
    min_loss_scale: float = Field(default=1.0, gt=0.0)
    """fp16: the loss scale has collapsed when it falls below this."""
    max_overflow_fraction: float = Field(default=0.5, gt=0.0, le=1.0)
    """fp16: collapse also when more than this fraction of the last overflow_window steps overflowed."""
    overflow_window: int = Field(default=20, ge=1)
    """fp16: window (steps) for max_overflow_fraction."""


class GradNormSpikeDetector(_Section):
    enabled: bool = True
    """EMA z-score of log global grad norm (before clipping)."""
    action: Action = Action.skip_step
    """What to do on a spike."""
    z_threshold: float = Field(default=6.0, gt=0.0)
    """Fire when (log norm - EMA mean) / EMA std exceeds this."""
    ema_alpha: float = Field(default=0.05, gt=0.0, lt=1.0)
    """EMA coefficient."""
    warmup_steps: int = Field(default=25, ge=0)
    """Steps observed before the detector may fire."""
    patience: int = Field(default=1, ge=1)
    """Consecutive spiking steps needed to fire."""
    min_ratio: float = Field(default=4.0, ge=1.0)
    """Also require the norm to exceed this multiple of the EMA level (guards against tiny variances)."""


class LossSpikeDetector(_Section):
    enabled: bool = True
    """Loss z-score against its EMA, loss far above the best smoothed loss or the initial loss, or a collapse back
    towards the initial loss."""
    action: Action = Action.rollback
    """What to do on divergence."""
    z_threshold: float = Field(default=6.0, gt=0.0)
    """Fire when (loss - EMA mean) / EMA std exceeds this."""
    ratio_threshold: float = Field(default=2.0, gt=1.0)
    """Fire when the smoothed loss exceeds this multiple of the best smoothed loss so far."""
    max_initial_ratio: float | None = Field(default=1.5, gt=1.0)
    """Fire (kind divergence) when the loss exceeds this multiple of the initial loss: the mean of the losses among
    the first 5 finite ones that were not skipped and not already this far above the mean so far. A healthy run
    never ends up far above where it started, so this rule needs no warmup (``warmup_steps`` does not apply to
    it): it catches the blow-up in the first steps of a too-high LR, which the warmup would hide. The rise must
    also be 4 batch-noise deviations; still, for a loss with more than ~15% batch noise (MSE on a few samples)
    raise it or disable it. None disables."""
    collapse_fraction: float | None = Field(default=0.8, gt=0.0, le=1.0)
    """Fire (kind divergence) when the smoothed loss has given back this fraction of the progress it made, from
    the initial loss down to the best smoothed loss (a run that learned, then collapsed back towards where it
    started). Only once the best smoothed loss is at least 10% (and 4 batch-noise deviations) below the initial
    loss; no warmup. None disables."""
    ema_alpha: float = Field(default=0.05, gt=0.0, lt=1.0)
    """EMA coefficient for mean, variance and the smoothed loss."""
    warmup_steps: int = Field(default=25, ge=0)
    """Steps observed before the z-score and best-ratio rules may fire."""
    patience: int = Field(default=3, ge=1)
    """Consecutive anomalous steps needed to fire (any of the rules)."""


class VanishingDetector(_Section):
    enabled: bool = True
    """Global grad norm below a floor for N steps; per-layer norms decaying geometrically with depth."""
    action: Action = Action.record
    """What to do when gradients vanish."""
    min_grad_norm: float = Field(default=1e-7, ge=0.0)
    """Floor on the global grad norm."""
    patience: int = Field(default=20, ge=1)
    """Consecutive steps below the floor needed to fire."""
    depth_slope_threshold: float = Field(default=-0.5, lt=0.0)
    """Diagnose 'vanishing with depth' when the least-squares slope of ln(layer grad norm) per layer, measured
    from the output layer back toward the input (the way gradients flow), is below this: negative means the
    norms shrink toward the input; -0.5 is each layer about 0.6x the one above it."""
    warmup_steps: int = Field(default=10, ge=0)
    """Steps before the detector may fire."""


class StagnationDetector(_Section):
    enabled: bool = True
    """Update-to-weight ratio below a floor for N steps (training has stopped moving)."""
    action: Action = Action.record
    """What to do on stagnation."""
    min_update_ratio: float = Field(default=1e-7, ge=0.0)
    """Floor on ||lr * update|| / ||weights||."""
    patience: int = Field(default=5, ge=1)
    """Consecutive measurements below the floor needed to fire."""
    warmup_steps: int = Field(default=20, ge=0)
    """Steps before the detector may fire."""


class OscillationDetector(_Section):
    enabled: bool = True
    """Loss variance over a window far above its running level."""
    action: Action = Action.record
    """What to do on oscillation."""
    window: int = Field(default=20, ge=3)
    """Window (steps) of the short-term loss variance."""
    variance_ratio: float = Field(default=25.0, gt=1.0)
    """Fire when window variance exceeds this multiple of the long-run variance."""
    ema_alpha: float = Field(default=0.01, gt=0.0, lt=1.0)
    """EMA coefficient of the long-run variance."""
    warmup_steps: int = Field(default=50, ge=0)
    """Steps before the detector may fire."""
    patience: int = Field(default=5, ge=1)
    """Consecutive anomalous steps needed to fire."""


class Detectors(_Section):
    nonfinite: NonFiniteDetector = Field(default_factory=NonFiniteDetector)
    """Non-finite loss or gradients; fp16 loss-scale collapse."""
    grad_norm_spike: GradNormSpikeDetector = Field(default_factory=GradNormSpikeDetector)
    """Gradient-norm spikes."""
    loss_spike: LossSpikeDetector = Field(default_factory=LossSpikeDetector)
    """Loss spikes and divergence."""
    vanishing: VanishingDetector = Field(default_factory=VanishingDetector)
    """Vanishing gradients."""
    stagnation: StagnationDetector = Field(default_factory=StagnationDetector)
    """Stagnation."""
    oscillation: OscillationDetector = Field(default_factory=OscillationDetector)
    """Oscillation / noise."""
    max_skipped_steps: int = Field(default=5, ge=1)
    """skip_step escalates to rollback when more than this many steps were skipped ..."""
    skip_window: int = Field(default=50, ge=1)
    """... within this many steps."""


# ------------------------------------------------------------------------------------------------- telemetry
class Telemetry(_Section):
    layer_stats_every: int = Field(default=10, ge=0)
    """Per-layer gradient norms and update-to-weight ratio every N steps (0 = never)."""


# ---------------------------------------------------------------------------------------------- checkpoint
class Checkpoint(_Section):
    every_steps: int = Field(default=50, ge=1)
    """Save a checkpoint every N steps (and at the end)."""
    keep: int = Field(default=3, ge=1, le=1000)
    """Checkpoints retained (newest first) ..."""
    keep_healthy: bool = True
    """... plus, always, the newest healthy one."""


# ------------------------------------------------------------------------------------------------ recovery
class TightenOrder(StrEnum):
    auto = "auto"
    lr_first = "lr_first"
    clip_first = "clip_first"
    both = "both"


class Recovery(_Section):
    max_retries: int = Field(default=3, ge=0, le=100)
    """Retries after numeric divergence before the run fails."""
    max_crash_restarts: int = Field(default=3, ge=0, le=100)
    """Restarts after crashes (worker died, OOM, exception), counted separately."""
    rollback_margin_steps: int = Field(default=0, ge=0)
    """Resume from a healthy checkpoint at least this many steps before the onset."""
    lr_factor: float = Field(default=0.5, gt=0.0, lt=1.0)
    """Multiply the learning rate by this on each numeric retry."""
    clip_factor: float = Field(default=0.5, gt=0.0, lt=1.0)
    """Multiply the clip threshold by this on each numeric retry."""
    clip_to_median_multiple: float | None = Field(default=None, gt=0.0)
    """Instead of clip_factor, set the clip threshold to this multiple of the median healthy grad norm."""
    tighten_order: TightenOrder = TightenOrder.auto
    """auto: LR first for Adam-family optimizers, clipping first for SGD; or lr_first, clip_first, both."""
    rewarm_steps: int = Field(default=20, ge=0)
    """Re-warm the LR linearly over this many steps after a rollback."""
    skip_data_window: bool = False
    """Skip the data between the resumed checkpoint and the onset step."""
    min_lr: float = Field(default=1e-6, gt=0.0)
    """Floor for the tightened learning rate."""
    min_clip: float = Field(default=0.01, gt=0.0)
    """Floor for the tightened clip threshold."""
    fp16_to_bf16: bool = True
    """Switch fp16 to bf16 when the loss scale collapsed."""
    early_failure_steps: int = Field(default=20, ge=0)
    """A retry that fails within this many steps of its start resumes further back next time."""
    in_place: bool = True
    """Apply numeric rollbacks inside the running worker group instead of restarting it."""


# ----------------------------------------------------------------------------------------------- resources
class Resources(_Section):
    num_workers: int = Field(default=1, ge=1, le=4096)
    """Ray Train workers (data-parallel ranks)."""
    use_gpu: bool = False
    """Place workers on GPUs (NCCL); CPU workers use gloo."""
    cpus_per_worker: float = Field(default=1.0, gt=0.0, le=512)
    """CPUs reserved per worker."""
    gpus_per_worker: float = Field(default=0.0, ge=0.0, le=16)
    """GPUs reserved per worker (when use_gpu)."""


# --------------------------------------------------------------------------------------------- distributed
class Compression(StrEnum):
    none = "none"
    fp16 = "fp16"
    bf16 = "bf16"
    powersgd = "powersgd"


class Distributed(_Section):
    compression: Compression = Compression.none
    """DDP gradient compression comm hook (bf16 needs NCCL)."""
    powersgd_rank: int = Field(default=2, ge=1, le=1024)
    """PowerSGD matrix approximation rank."""
    powersgd_start_iter: int = Field(default=10, ge=1)
    """PowerSGD: steps of vanilla allreduce before compression starts."""
    activation_checkpointing: bool = False
    """Recompute tiny_gpt block activations in the backward pass."""
    freeze_first_n_blocks: int = Field(default=0, ge=0)
    """Freeze the first N blocks (tiny_gpt blocks, deep_mlp layers)."""


# -------------------------------------------------------------------------------------------------- faults
class _Fault(_Section):
    step: int = Field(ge=0)
    """Step at which the fault fires."""
    attempt: int = Field(default=1, ge=1)
    """The only attempt in which the fault fires."""
    rank: int | None = Field(default=None, ge=0)
    """Rank that fires the fault (None: every rank)."""


class NanLossFault(_Fault):
    """Replace the loss with NaN."""

    type: Literal["nan_loss"] = "nan_loss"


class GradScaleFault(_Fault):
    """Multiply every gradient by factor after backward."""

    type: Literal["grad_scale"] = "grad_scale"
    factor: float = Field(default=1e4, gt=0.0)
    """Gradient multiplier."""


class BatchScaleFault(_Fault):
    """Multiply the inputs (float data) or targets (token data: loss) of one batch by factor."""

    type: Literal["batch_scale"] = "batch_scale"
    factor: float = Field(default=1e3, gt=0.0)
    """Batch multiplier."""


class KillWorkerFault(_Fault):
    """SIGKILL the worker process."""

    type: Literal["kill_worker"] = "kill_worker"


class CorruptCheckpointFault(_Fault):
    """Corrupt the newest checkpoint on disk (after it was written), then crash."""

    type: Literal["corrupt_checkpoint"] = "corrupt_checkpoint"


Fault = Annotated[
    NanLossFault | GradScaleFault | BatchScaleFault | KillWorkerFault | CorruptCheckpointFault,
    Field(discriminator="type"),
]


# -------------------------------------------------------------------------------------------------- recipe
class CrossFieldErrors(ValueError):
    """Raised by ``Recipe``'s cross-field checks: keeps each (field path, message) pair apart."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{path}: {msg}" for path, msg in errors))


class Recipe(_Section):
    """A Ballast stability recipe (``apiVersion: ballast/v1``, ``kind: StabilityRecipe``)."""

    api_version: Literal["ballast/v1"] = Field(default=API_VERSION, alias="apiVersion")
    """Schema version."""
    kind: Literal["StabilityRecipe"] = KIND
    """Document kind."""
    name: str = Field(min_length=1, max_length=100, pattern=r"^[a-z0-9]([a-z0-9._-]*[a-z0-9])?$")
    """Run name: lowercase letters, digits, '.', '_' and '-'."""
    description: str = Field(default="", max_length=4000)
    """Free text."""
    model: ModelSpec = Field(default_factory=TinyGPTModel)
    """The model to train."""
    data: DataSpec = Field(default_factory=MarkovData)
    """The data to train on."""
    training: Training = Field(default_factory=Training)
    """Steps, batch, accumulation, seed."""
    optimizer: Optimizer = Field(default_factory=Optimizer)
    """Optimizer and its hyper-parameters."""
    schedule: Schedule = Field(default_factory=Schedule)
    """Learning-rate warmup and decay."""
    precision: Precision = Field(default_factory=Precision)
    """Compute precision and loss scaling."""
    clipping: Clipping = Field(default_factory=Clipping)
    """Gradient clipping."""
    detectors: Detectors = Field(default_factory=Detectors)
    """Anomaly detectors, thresholds and actions."""
    telemetry: Telemetry = Field(default_factory=Telemetry)
    """What is measured beyond the per-step basics."""
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    """Checkpoint cadence and retention."""
    recovery: Recovery = Field(default_factory=Recovery)
    """What the orchestrator does after a divergence or crash."""
    resources: Resources = Field(default_factory=Resources)
    """Workers and their resources."""
    distributed: Distributed = Field(default_factory=Distributed)
    """Data-parallel options."""
    faults: list[Fault] = Field(default_factory=list, max_length=64)
    """Injected faults (tests and demos)."""

    @model_validator(mode="before")
    @classmethod
    def _check_union_sections(cls, data: Any) -> Any:
        """Name the offending value when model/data is not a mapping or names an unknown kind."""
        if not isinstance(data, dict):
            return data
        errors: list[tuple[str, str]] = []
        for section, known in (("model", _MODEL_NAMES), ("data", _DATA_NAMES)):
            value = data.get(section)
            if value is None or isinstance(value, BaseModel):
                continue
            if not isinstance(value, dict):
                errors.append((section, f"Input should be a valid dictionary (a mapping), got {type(value).__name__}"))
            elif "name" in value and value["name"] not in known:
                msg = f"unknown {section} {value['name']!r}; expected one of: {', '.join(known)}"
                errors.append((f"{section}.name", msg))
        if errors:
            raise CrossFieldErrors(errors)
        return data

    @model_validator(mode="after")
    def _cross_checks(self) -> Recipe:
        errors: list[tuple[str, str]] = []
        max_steps = self.training.max_steps
        warmup = self.schedule.resolved_warmup_steps(max_steps)
        if warmup >= max_steps:
            msg = f"warmup ({warmup} steps) must be shorter than training.max_steps ({max_steps})"
            errors.append(("schedule.warmup_steps", msg))
        allowed = _COMPATIBLE_DATA.get(self.model.name)
        if allowed is not None and self.data.name not in allowed and self.data.name != "custom":
            msg = f"model {self.model.name!r} needs data {sorted(allowed)}, got {self.data.name!r}"
            errors.append(("data.name", msg))
        if isinstance(self.model, TinyGPTModel) and isinstance(self.data, MarkovData):
            if self.data.vocab_size != self.model.vocab_size:
                msg = f"must equal model.vocab_size ({self.model.vocab_size}), got {self.data.vocab_size}"
                errors.append(("data.vocab_size", msg))
            if self.data.seq_len > self.model.context:
                errors.append(("data.seq_len", f"must not exceed model.context ({self.model.context})"))
        if self.distributed.compression is Compression.bf16 and not self.resources.use_gpu:
            msg = "bf16 compression needs NCCL (resources.use_gpu: true); gloo cannot"
            errors.append(("distributed.compression", msg))
        if self.resources.use_gpu and self.resources.gpus_per_worker <= 0:
            errors.append(("resources.gpus_per_worker", "must be > 0 when resources.use_gpu is true"))
        for i, fault in enumerate(self.faults):
            if fault.step >= max_steps:
                errors.append((f"faults.{i}.step", f"step {fault.step} is beyond training.max_steps ({max_steps})"))
            if fault.rank is not None and fault.rank >= self.resources.num_workers:
                errors.append((f"faults.{i}.rank", f"rank {fault.rank} >= resources.num_workers"))
        if errors:
            raise CrossFieldErrors(errors)
        return self

    def warnings(self) -> list[str]:
        """Settings that are legal but probably not what the author wants."""
        out: list[str] = []
        if self.precision.dtype is DType.fp16 and self.precision.loss_scaling is LossScaling.none:
            out.append("precision.loss_scaling: fp16 without loss scaling will underflow small gradients")
        if self.clipping.method is ClipMethod.none and self.detectors.grad_norm_spike.action is Action.record:
            out.append("clipping.method: no clipping and grad-norm spikes only recorded")
        return out


# ------------------------------------------------------------------------------------------- import policy
def _check_import_string(v: str, info: ValidationInfo) -> str:
    if not _IMPORT_RE.match(v):
        raise ValueError(f"{v!r} is not a 'module:function' import string")
    allowed: list[str] = list((info.context or {}).get("allowed_import_modules", []))
    module = v.split(":", 1)[0]
    if not any(module == a or module.startswith(a + ".") for a in allowed):
        raise ValueError(
            f"module {module!r} is not on the operator's allow-list (BALLAST_ALLOWED_IMPORT_MODULES: {allowed})"
        )
    return v


# ----------------------------------------------------------------------------------------------- loading
@dataclass(frozen=True)
class FieldError:
    path: str
    message: str
    line: int | None = None

    def __str__(self) -> str:
        where = f" (line {self.line})" if self.line else ""
        return f"{self.path}: {self.message}{where}"


class RecipeError(ValueError):
    """A recipe that cannot be accepted; ``errors`` names each field and problem."""

    def __init__(self, errors: list[FieldError]) -> None:
        self.errors = errors
        super().__init__("; ".join(str(e) for e in errors))


class _NoAliasLoader(yaml.SafeLoader):
    """Safe loader that refuses aliases (no billion-laughs) and duplicate keys."""

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()  # type: ignore[no-untyped-call]
            raise yaml.constructor.ConstructorError(
                None, None, "YAML aliases are not allowed in recipes", event.start_mark
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _line_of(root: Any, loc: tuple[Any, ...]) -> int | None:
    """Walk a composed YAML node tree along a pydantic error location and return its 1-based line."""
    node = root
    line: int | None = node.start_mark.line + 1 if node is not None else None
    for part in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == part:
                    nxt = v
                    line = k.start_mark.line + 1
                    break
            if nxt is None:
                return line
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            # discriminator tags (e.g. 'tiny_gpt') appear in pydantic locs but not in the document
            continue
    return line


_TAG_PARTS = {"tiny_gpt", "deep_mlp", "rnn", "linear", "custom", "markov", "regression", "sequence", "nan_loss",
              "grad_scale", "batch_scale", "kill_worker", "corrupt_checkpoint"}


def _document_loc(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    """Drop the union tags pydantic inserts after ``model``, ``data`` and ``faults.N`` (they are not keys)."""
    out: list[Any] = []
    for i, part in enumerate(loc):
        prev = loc[i - 1] if i else None
        after_union = prev in ("model", "data") and i == 1 or (isinstance(prev, int) and i == 2 and loc[0] == "faults")
        if part in _TAG_PARTS and after_union:
            continue
        out.append(part)
    return tuple(out)


def _errors_from_validation(exc: ValidationError, root: Any) -> list[FieldError]:
    out: list[FieldError] = []
    for err in exc.errors(include_url=False):
        loc = _document_loc(tuple(err["loc"]))
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        cross = (err.get("ctx") or {}).get("error")
        if not loc and isinstance(cross, CrossFieldErrors):
            # cross-field errors carry their own paths (messages may contain "; " or ": " themselves)
            for path, m in cross.errors:
                parts = tuple(int(p) if p.isdigit() else p for p in path.split("."))
                out.append(FieldError(path, m, _line_of(root, parts) if root is not None else None))
            continue
        path = ".".join(str(p) for p in loc) or "<recipe>"
        if err["type"] == "extra_forbidden":
            msg = "unknown field"
        out.append(FieldError(path, msg, _line_of(root, loc) if root is not None else None))
    return out


def validate_recipe_data(data: Any, *, allowed_import_modules: list[str] | None = None) -> Recipe:
    """Validate already-parsed data (e.g. a JSON body) into a Recipe, raising RecipeError."""
    if not isinstance(data, dict):
        raise RecipeError([FieldError("<recipe>", "a recipe must be a mapping")])
    try:
        return Recipe.model_validate(data, context={"allowed_import_modules": allowed_import_modules or []})
    except ValidationError as exc:
        raise RecipeError(_errors_from_validation(exc, None)) from None


def parse_yaml(text: str | bytes, *, max_bytes: int = DEFAULT_MAX_RECIPE_BYTES) -> tuple[Any, Any]:
    """Parse YAML text safely; returns (data, composed node tree). Raises RecipeError."""
    size = len(text.encode("utf-8") if isinstance(text, str) else text)
    if size > max_bytes:
        raise RecipeError([FieldError("<document>", f"recipe is {size} bytes, over the limit of {max_bytes} bytes")])
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RecipeError([FieldError("<document>", f"not UTF-8 text ({exc.reason})")]) from None
    try:
        root = yaml.compose(text, Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
        data = yaml.load(text, Loader=_NoAliasLoader)  # noqa: S506
    except yaml.MarkedYAMLError as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else None
        raise RecipeError([FieldError("<document>", f"invalid YAML: {exc.problem}", line)]) from None
    except yaml.YAMLError as exc:
        raise RecipeError([FieldError("<document>", f"invalid YAML: {exc}")]) from None
    return data, root


def load_recipe(
    text: str | bytes,
    *,
    max_bytes: int = DEFAULT_MAX_RECIPE_BYTES,
    allowed_import_modules: list[str] | None = None,
) -> Recipe:
    """YAML (or JSON, a YAML subset) text → Recipe. Raises RecipeError naming each field and line."""
    data, root = parse_yaml(text, max_bytes=max_bytes)
    if not isinstance(data, dict):
        raise RecipeError([FieldError("<recipe>", "a recipe must be a YAML mapping")])
    try:
        return Recipe.model_validate(data, context={"allowed_import_modules": allowed_import_modules or []})
    except ValidationError as exc:
        raise RecipeError(_errors_from_validation(exc, root)) from None


def recipe_to_dict(recipe: Recipe) -> dict[str, Any]:
    return recipe.model_dump(mode="json", by_alias=True)


def dump_recipe(recipe: Recipe) -> str:
    """Recipe → canonical YAML (all defaults filled, key order of the schema)."""
    return yaml.safe_dump(recipe_to_dict(recipe), sort_keys=False, default_flow_style=False)


def recipe_json_schema() -> dict[str, Any]:
    schema = Recipe.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "Ballast StabilityRecipe (ballast/v1)"
    return schema
