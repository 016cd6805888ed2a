"""How the model is optimised: steps and batches, optimizer, LR schedule, precision, clipping."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field, StrictBool, StrictFloat, StrictInt, field_validator, model_validator

from contracts.recipe.base import Section

MAX_LR = 100.0
"""The highest ``optimizer.lr`` a recipe (and so an attempt's override) may hold."""


class Training(Section):
    max_steps: StrictInt = Field(default=200, ge=1, le=10_000_000)
    """Optimizer steps to train for."""
    batch_size: StrictInt = Field(default=16, ge=1, le=1_000_000)
    """Micro-batch size per worker."""
    grad_accum_steps: StrictInt = Field(default=1, ge=1, le=4096)
    """Micro-batches accumulated per optimizer step."""
    seed: StrictInt = Field(default=0, ge=0, le=2**53 - 1)
    """Seed for initialisation and the data stream; at most 2**53 - 1, so that every rank's derived seed fits
    torch's 64-bit generator (and the dashboard shows it exactly)."""
    eval_interval: StrictInt = Field(default=0, ge=0)
    """Evaluate on held-out batches every N steps, at the attempt's start and at its end (0 = never)."""
    eval_batches: StrictInt = Field(default=4, ge=1, le=10_000)
    """Held-out batches per evaluation (per worker): the same ones every time, so the eval series is comparable."""
    deterministic: StrictBool = False
    """Use deterministic algorithms (for resume-equivalence checks; slower)."""


class OptimizerName(StrEnum):
    adamw = "adamw"
    adam = "adam"
    sgd = "sgd"


class NoDecay(StrEnum):
    bias = "bias"
    norm = "norm"
    embedding = "embedding"


class Optimizer(Section):
    name: OptimizerName = OptimizerName.adamw
    """Optimizer family."""
    lr: StrictFloat = Field(default=1e-3, gt=0.0, le=MAX_LR)
    """Peak learning rate."""
    betas: tuple[StrictFloat, StrictFloat] = (0.9, 0.95)
    """Adam betas (beta1, beta2), each in [0, 1)."""
    eps: StrictFloat = Field(default=1e-8, gt=0.0, le=1.0)
    """Adam epsilon."""
    weight_decay: StrictFloat = Field(default=0.0, ge=0.0, le=10.0)
    """Decoupled (AdamW) or L2 (Adam, SGD) weight decay."""
    no_decay: list[NoDecay] = Field(default_factory=lambda: [NoDecay.bias, NoDecay.norm], max_length=3)
    """Parameters kept out of weight decay: ``bias`` (every bias), ``norm`` (LayerNorm, RMSNorm, GroupNorm,
    BatchNorm weights), ``embedding`` (nn.Embedding weights); [] decays everything."""
    momentum: StrictFloat = Field(default=0.9, ge=0.0, lt=1.0)
    """SGD momentum."""
    nesterov: StrictBool = False
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


class Schedule(Section):
    preset: SchedulePreset | None = None
    """Named defaults (pretrain, sft, rlhf) for the fields left unset."""
    warmup_steps: StrictInt | None = Field(default=None, ge=0)
    """Linear warmup length in steps (exclusive with warmup_fraction)."""
    warmup_fraction: StrictFloat | None = Field(default=None, ge=0.0, lt=1.0)
    """Linear warmup length as a fraction of training.max_steps."""
    decay: Decay = Decay.cosine
    """Shape of the decay after warmup."""
    min_lr_ratio: StrictFloat = Field(default=0.1, ge=0.0, le=1.0)
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


class DType(StrEnum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class LossScaling(StrEnum):
    dynamic = "dynamic"
    static = "static"
    none = "none"


class Precision(Section):
    dtype: DType = DType.fp32
    """Autocast compute dtype (master weights stay fp32)."""
    loss_scaling: LossScaling = LossScaling.dynamic
    """Loss scaling mode; used only with fp16."""
    init_scale: StrictFloat = Field(default=2.0**16, gt=0.0, le=2.0**32)
    """Initial dynamic loss scale."""
    growth_factor: StrictFloat = Field(default=2.0, gt=1.0, le=100.0)
    """Scale multiplier after growth_interval overflow-free steps."""
    backoff_factor: StrictFloat = Field(default=0.5, gt=0.0, lt=1.0)
    """Scale multiplier on an overflow step."""
    growth_interval: StrictInt = Field(default=2000, ge=1)
    """Overflow-free steps before the scale grows."""
    static_scale: StrictFloat = Field(default=1024.0, gt=0.0, le=2.0**32)
    """The fixed scale used when loss_scaling is static."""


class ClipMethod(StrEnum):
    none = "none"
    global_norm = "global_norm"
    per_layer = "per_layer"
    adaptive = "adaptive"
    zscore = "zscore"


class Clipping(Section):
    method: ClipMethod = ClipMethod.global_norm
    """none, global_norm, per_layer (each parameter tensor to max_norm), adaptive (AGC), zscore (EMA)."""
    max_norm: StrictFloat = Field(default=1.0, gt=0.0, le=1e6)
    """Norm threshold for global_norm and per_layer; the ceiling for zscore."""
    agc_lambda: StrictFloat = Field(default=0.01, gt=0.0, le=10.0)
    """AGC: largest allowed unit-wise ratio of gradient norm to weight norm."""
    agc_eps: StrictFloat = Field(default=1e-3, gt=0.0, le=1.0)
    """AGC: floor on the weight norm, so zero-initialised units can still move."""
    zscore_alpha: StrictFloat = Field(default=0.02, gt=0.0, lt=1.0)
    """Z-score clipping: EMA coefficient of the grad-norm mean and variance."""
    zscore_threshold: StrictFloat = Field(default=3.0, gt=0.0, le=100.0)
    """Z-score clipping: norms above mean + z * std are clipped to that bound."""
    zscore_warmup: StrictInt = Field(default=20, ge=0)
    """Z-score clipping: steps of plain global-norm clipping while the EMA settles."""
