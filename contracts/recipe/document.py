"""The recipe document: every section together, and the checks that span sections."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, model_validator

from contracts.recipe.base import API_VERSION, DATA_NAMES, KIND, LOSS_NAMES, MODEL_NAMES, Section
from contracts.recipe.code import Code
from contracts.recipe.data import COMPATIBLE_DATA, USER_DATA, DataSpec, MarkovData
from contracts.recipe.detectors import Action, Detectors
from contracts.recipe.faults import Fault
from contracts.recipe.loss import LossSpec, ModelLoss
from contracts.recipe.model import BUILTIN_MODELS, ModelSpec, TinyGPTModel
from contracts.recipe.operations import Checkpoint, Compression, Distributed, Recovery, Resources, Strategy, Telemetry
from contracts.recipe.success import Success
from contracts.recipe.training import ClipMethod, Clipping, DType, LossScaling, Optimizer, Precision, Schedule, Training


class CrossFieldErrors(ValueError):
    """Raised by ``Recipe``'s cross-field checks: keeps each (field path, message) pair apart."""

    def __init__(self, errors: list[tuple[str, str]]) -> None:
        self.errors = errors
        super().__init__("; ".join(f"{path}: {msg}" for path, msg in errors))

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across Ray's process boundary
        return (type(self), (self.errors,))


class Recipe(Section):
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
    loss: LossSpec = Field(default_factory=ModelLoss)
    """How outputs become the loss (default: the model's own)."""
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
    success: Success = Field(default_factory=Success)
    """What an attempt must show at its end to count as succeeded (the model, not the step counter)."""
    resources: Resources = Field(default_factory=Resources)
    """Workers and their resources."""
    distributed: Distributed = Field(default_factory=Distributed)
    """Data-parallel options."""
    code: Code = Field(default_factory=Code)
    """Your own code (the package of a custom model or data factory), shipped to the Ray workers."""
    faults: list[Fault] = Field(default_factory=list, max_length=64)
    """Injected faults (tests and demos)."""

    @model_validator(mode="before")
    @classmethod
    def _check_union_sections(cls, data: Any) -> Any:
        """Name the offending value when model/data is not a mapping or names an unknown kind."""
        if not isinstance(data, dict):
            return data
        errors: list[tuple[str, str]] = []
        for section, known in (("model", MODEL_NAMES), ("data", DATA_NAMES), ("loss", LOSS_NAMES)):
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
        errors += self._model_data_errors()
        if self.distributed.compression is Compression.bf16 and not self.resources.use_gpu:
            msg = "bf16 compression needs NCCL (resources.use_gpu: true); gloo cannot"
            errors.append(("distributed.compression", msg))
        errors += self._fsdp_errors()
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

    def _fsdp_errors(self) -> list[tuple[str, str]]:
        """What ``distributed.strategy: fsdp`` cannot combine with (each refused by name, with what to do)."""
        d = self.distributed
        if d.strategy is not Strategy.fsdp:
            return []
        errors: list[tuple[str, str]] = []
        if d.compression is not Compression.none:
            errors.append(("distributed.compression", f"{d.compression.value} is a DDP comm hook, not for strategy: "
                           "fsdp (FSDP reduce-scatters its gradients itself); use compression: none, or strategy: ddp"))
        if d.lora is not None:
            errors.append(("distributed.lora", "LoRA adapters are not supported with strategy: fsdp (use strategy: "
                           "ddp; the adapters are small enough to replicate)"))
        if self.precision.dtype is DType.fp16:
            errors.append(("precision.dtype", "fp16 is not supported with strategy: fsdp (its loss scaler is not "
                           "shard-aware); use bf16 or fp32"))
        return errors

    def _model_data_errors(self) -> list[tuple[str, str]]:
        """The model, its data and its loss must fit together."""
        errors: list[tuple[str, str]] = []
        allowed = COMPATIBLE_DATA.get(self.model.name)
        if allowed is not None and self.data.name not in allowed and self.data.name not in USER_DATA:
            msg = f"model {self.model.name!r} needs data {sorted(allowed)}, got {self.data.name!r}"
            errors.append(("data.name", msg))
        if self.model.name in BUILTIN_MODELS and self.loss.name != "model":
            msg = f"model {self.model.name!r} computes its own loss; leave the loss section out (name: model)"
            errors.append(("loss.name", msg))
        if isinstance(self.model, TinyGPTModel) and isinstance(self.data, MarkovData):
            if self.data.vocab_size != self.model.vocab_size:
                msg = f"must equal model.vocab_size ({self.model.vocab_size}), got {self.data.vocab_size}"
                errors.append(("data.vocab_size", msg))
            if self.data.seq_len > self.model.context:
                errors.append(("data.seq_len", f"must not exceed model.context ({self.model.context})"))
        return errors

    def warnings(self) -> list[str]:
        """Settings that are legal but probably not what the author wants."""
        out: list[str] = []
        if self.precision.dtype is DType.fp16 and self.precision.loss_scaling is LossScaling.none:
            out.append("precision.loss_scaling: fp16 without loss scaling will underflow small gradients")
        if self.clipping.method is ClipMethod.none and self.detectors.grad_norm_spike.action is Action.record:
            out.append("clipping.method: no clipping and grad-norm spikes only recorded")
        return out
