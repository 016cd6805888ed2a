"""How a run is operated: telemetry, checkpoints, recovery policy, resources, data-parallel options."""

from __future__ import annotations

from enum import StrEnum
from pathlib import PurePosixPath

from pydantic import Field, StrictBool, StrictFloat, StrictInt, field_validator

from contracts.recipe.base import Section


class Exporter(StrEnum):
    tensorboard = "tensorboard"
    mlflow = "mlflow"


class Telemetry(Section):
    layer_stats_every: StrictInt = Field(default=10, ge=0)
    """Per-layer gradient norms and update-to-weight ratio every N steps (0 = never)."""
    export: list[Exporter] = Field(default_factory=list)
    """Trackers that rank 0 also writes the run's series to: ``tensorboard`` (event files under
    ``<export root>/run-<id>/attempt-<n>/``), ``mlflow`` (one MLflow run per Ballast run). Each needs its extra
    installed (``pip install 'ballast[tensorboard]'`` / ``'ballast[mlflow]'``); a missing one is logged, not fatal."""
    export_dir: str | None = None
    """A subdirectory of the server's export root (``BALLAST_TELEMETRY_EXPORT_DIR``) to write under instead of the
    root itself: relative, without ``..`` (a recipe never picks a path outside the root)."""
    mlflow_experiment: str | None = Field(default=None, min_length=1, max_length=200)
    """The MLflow experiment of this run (default: the server's ``BALLAST_MLFLOW_EXPERIMENT``)."""

    @field_validator("export")
    @classmethod
    def _unique(cls, v: list[Exporter]) -> list[Exporter]:
        if len(set(v)) != len(v):
            raise ValueError("each exporter may be named once")
        return v

    @field_validator("export_dir")
    @classmethod
    def _relative(cls, v: str | None) -> str | None:
        if v is None:
            return v
        path = PurePosixPath(v.replace("\\", "/"))
        if not v.strip() or path.is_absolute() or ".." in path.parts or ":" in v:
            raise ValueError("must be a relative path inside the export root, without '..'")
        return path.as_posix()


class Checkpoint(Section):
    every_steps: StrictInt = Field(default=50, ge=1)
    """Save a checkpoint every N steps (and at the end)."""
    keep: StrictInt = Field(default=3, ge=1, le=1000)
    """Checkpoints retained (newest first) ..."""
    keep_healthy: StrictBool = True
    """... plus, always, the newest healthy one."""


class TightenOrder(StrEnum):
    auto = "auto"
    lr_first = "lr_first"
    clip_first = "clip_first"
    both = "both"


class RecoveryStrategy(StrEnum):
    ballast = "ballast"
    restart_latest = "restart_latest"


PROBE_MIN_STEPS = 10
"""The fewest steps a default probe gives a candidate: fewer say little beyond whether it blows up at once."""
PROBE_MAX_STEPS = 100
"""The most: on a long run, a hundred steps tell the candidates apart and cost a small fraction of it."""


class ProbeMode(StrEnum):
    auto = "auto"
    on = "on"
    off = "off"


class LrProbe(Section):
    """Choose a numeric retry's LR by evidence rather than by the cut alone. When a retry lowers the LR, the new
    attempt first trains ``steps`` steps from its rollback point at each of ``candidates`` LRs (the policy's cut
    LR, then each ``spacing`` times the one before, never below ``min_lr``), each at the constant LR the retry
    reaches once warmed up, and keeps the one whose loss ends lowest without a rollback-worthy anomaly. After a run
    that never learned, the first candidate is ``1 / spacing`` times the ended LR instead (the lowest cut goes),
    and while the highest LR tried is the best the probe climbs on (twice ``candidates`` LRs above at most). The
    descent through the candidates stops once one scores worse than one above it; when the cut then scores best
    and the ended attempt failed within the probe's span of the retry's start point, the LR between the cut and
    the one that failed is tried instead. The probe's steps are charged to the run (the attempt's
    ``plan.lr_probe.steps_run``)."""

    mode: ProbeMode = ProbeMode.auto
    """auto: probe when its steps (candidates × steps) are at most ``max_fraction`` of ``training.max_steps`` (on a
    run too short for that, a probe costs more than it can save); on: always; off: never (the cut LR is kept)."""
    candidates: StrictInt = Field(default=3, ge=2, le=8)
    """LRs tried, the policy's cut LR first."""
    spacing: StrictFloat = Field(default=0.25, gt=0.0, lt=1.0)
    """Each candidate is this times the previous one."""
    steps: StrictInt | None = Field(default=None, ge=4, le=100_000)
    """Steps per candidate; default: an equal share of ``max_fraction`` of the run, between 10 and 100."""
    max_fraction: StrictFloat = Field(default=0.2, gt=0.0, le=1.0)
    """The probe's steps as a fraction of ``training.max_steps``: the default ``steps`` and ``auto``'s bound."""

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_bool(cls, v: object) -> object:
        """YAML 1.1 reads a bare ``on`` / ``off`` as a boolean: take it as the mode it spells."""
        if isinstance(v, bool):
            return ProbeMode.on if v else ProbeMode.off
        return v

    def steps_for(self, max_steps: int) -> int:
        """Steps per candidate in a run of ``max_steps`` steps."""
        if self.steps is not None:
            return self.steps
        return max(PROBE_MIN_STEPS, min(PROBE_MAX_STEPS, int(self.max_fraction * max_steps / self.candidates)))

    def active(self, max_steps: int) -> bool:
        """Whether a retry that lowers the LR probes, in a run of ``max_steps`` steps."""
        if self.mode is ProbeMode.auto:
            return self.candidates * self.steps_for(max_steps) <= self.max_fraction * max_steps
        return self.mode is ProbeMode.on


class Recovery(Section):
    strategy: RecoveryStrategy = RecoveryStrategy.ballast
    """ballast: roll back to a healthy checkpoint and tighten; restart_latest: resume the newest checkpoint with
    the same settings (what Ray Train's FailureConfig and torchrun do; a baseline for benchmarks)."""
    max_retries: StrictInt = Field(default=3, ge=0, le=100)
    """Retries after numeric divergence before the run fails."""
    step_budget: StrictFloat | None = Field(default=3.0, ge=1.0, le=100.0)
    """The steps a run may execute across all its attempts, LR probes included, as a multiple of
    training.max_steps: a numeric retry that could need more than is left is not started, and the run fails saying
    so. Each retry from initialisation trains a whole run again, so a run that no tightening rescues (a fresh
    scenario whose every LR diverged spent 3.6x its steps on four attempts) is bounded by this as well as by
    max_retries. None: no bound."""
    max_crash_restarts: StrictInt = Field(default=3, ge=0, le=100)
    """Restarts after crashes (worker died, OOM, exception), counted separately."""
    rollback_margin_steps: StrictInt = Field(default=0, ge=0)
    """Resume from a healthy checkpoint at least this many steps before the onset."""
    lr_factor: StrictFloat = Field(default=0.5, gt=0.0, lt=1.0)
    """Multiply the learning rate by this on each numeric retry."""
    clip_factor: StrictFloat = Field(default=0.5, gt=0.0, lt=1.0)
    """Multiply the clip threshold by this on each numeric retry."""
    clip_to_median_multiple: StrictFloat | None = Field(default=None, gt=0.0)
    """Instead of clip_factor, set the clip threshold to this multiple of the median healthy grad norm."""
    tighten_order: TightenOrder = TightenOrder.auto
    """auto: LR first for Adam-family optimizers, clipping first for SGD; or lr_first, clip_first, both."""
    rewarm_steps: StrictInt = Field(default=20, ge=0)
    """Re-warm the LR linearly over this many steps after a retry that tightened the LR or clip (none after a dtype
    switch alone: the LR did not change)."""
    skip_data_window: StrictBool = False
    """Skip the data between the resumed checkpoint and the onset step."""
    min_lr: StrictFloat = Field(default=1e-6, gt=0.0)
    """Floor for the tightened learning rate."""
    min_clip: StrictFloat = Field(default=0.01, gt=0.0)
    """Floor for the tightened clip threshold."""
    fp16_to_bf16: StrictBool = True
    """Switch fp16 to bf16 when the loss scale collapsed or the values went non-finite in fp16: that retry
    changes the dtype only (fp16's range failed, not the step size)."""
    early_failure_steps: StrictInt = Field(default=20, ge=0)
    """A retry that fails within this many steps of its start resumes further back next time."""
    in_place: StrictBool = True
    """Apply numeric rollbacks inside the running worker group instead of restarting it."""
    lr_probe: LrProbe = Field(default_factory=LrProbe)
    """Choose a retry's LR by a short probe of a few candidates from the rollback point (see ``LrProbe``)."""


class Resources(Section):
    num_workers: StrictInt = Field(default=1, ge=1, le=4096)
    """Ray Train workers (data-parallel ranks)."""
    use_gpu: StrictBool = False
    """Place workers on GPUs (NCCL); CPU workers use gloo."""
    cpus_per_worker: StrictFloat = Field(default=1.0, gt=0.0, le=512)
    """CPUs reserved per worker."""
    gpus_per_worker: StrictFloat = Field(default=0.0, ge=0.0, le=16)
    """GPUs reserved per worker (when use_gpu)."""
    step_timeout_s: StrictFloat = Field(default=600.0, ge=1.0, le=86_400.0)
    """The step-progress deadline: an attempt with no step for this long is ended as crashed ("no step for N s
    (hung?)"), its worker group torn down and resumed from its newest checkpoint. The worker group's collective
    timeout (torch.distributed) is derived from it, as the backstop when no scheduler watches."""


class Compression(StrEnum):
    none = "none"
    fp16 = "fp16"
    bf16 = "bf16"
    powersgd = "powersgd"


class Strategy(StrEnum):
    ddp = "ddp"
    fsdp = "fsdp"


class LoRA(Section):
    """Low-rank adapters (LoRA, via the optional ``peft`` package) on the named layers; everything else is frozen."""

    r: StrictInt = Field(default=8, ge=1, le=4096)
    """Adapter rank."""
    alpha: StrictFloat = Field(default=16.0, gt=0.0, le=1e6)
    """Scaling numerator: the adapter's update is multiplied by alpha / r."""
    dropout: StrictFloat = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapter's input."""
    target_modules: list[str] = Field(min_length=1, max_length=64)
    """Names of the layers to adapt (a module whose name is one of these or ends in '.' + one of these), e.g.
    ``[c_attn]`` for GPT-2; linear, embedding and convolution layers (and GPT-2's Conv1D)."""


class Distributed(Section):
    strategy: Strategy = Strategy.ddp
    """How the ranks hold the model: ``ddp`` (every rank a full replica, gradients all-reduced) or ``fsdp`` (FSDP2
    ``fully_shard`` per block and on the root: parameters, gradients and optimizer state sharded across the ranks;
    checkpoints written shard by shard through ``torch.distributed.checkpoint`` and resumable at another world
    size). FSDP takes no compression, no LoRA and no fp16."""
    compression: Compression = Compression.none
    """DDP gradient compression comm hook (bf16 needs NCCL)."""
    powersgd_rank: StrictInt = Field(default=2, ge=1, le=1024)
    """PowerSGD matrix approximation rank."""
    powersgd_start_iter: StrictInt = Field(default=10, ge=1)
    """PowerSGD: steps of vanilla allreduce before compression starts."""
    activation_checkpointing: StrictBool = False
    """Recompute each block's activations in the backward pass (any model whose blocks were found)."""
    freeze_first_n_blocks: StrictInt = Field(default=0, ge=0)
    """Freeze the first N blocks (tiny_gpt blocks, deep_mlp layers, a custom model's found blocks)."""
    lora: LoRA | None = None
    """Train LoRA adapters only (the base weights frozen); the checkpoint holds the adapted module's state dict."""
