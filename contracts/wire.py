"""The wire between workers and control plane: the attempt spec, event envelopes and the attempt outcome.

Every event is a plain dict envelope ``{"seq": int, "type": str, "data": {...}}`` with ``seq`` increasing by one
per attempt, so the store can ingest idempotently (a redelivered event never duplicates a row). Only rank 0
emits; detector decisions are identical on all ranks because their inputs are all-reduced first. On the Ray
channel the envelope also carries ``attempt`` and ``ts``.

Event types and their ``data``:

- ``metric``: step, loss, grad_norm (before clipping), grad_norm_clipped, lr, loss_scale, throughput
  (samples/s), skipped (bool)
- ``layer_stats``: step, layer_grad_norms {name: float}, update_ratio (float), diagnosis (str | None)
- ``anomaly``: step, rank, kind, detector, value, threshold, action, details {...}
- ``checkpoint``: step, uri, sha256, healthy (bool), verdict {...}, metrics {...}
- ``eval``: step (completed steps, like a checkpoint's: the weights after that many updates), eval_loss (mean over
  ``training.eval_batches`` held-out batches on every rank; None when not finite), batches (in that mean). Sparse:
  every ``training.eval_interval`` steps, at the attempt's start and at its end.
- ``lr_probe``: the LR probe an attempt ran before training (``recovery.lr_probe``, ``workers/lr_probe.py``):
  start_step, steps (per candidate), steps_run (all candidates), candidates [{lr, score, failed, steps}], chosen
  (the LR the attempt trains at), reason; when the chosen candidate trained cleanly and the attempt dropped a ramp,
  rewarm_steps (0) and/or if_clean (the settings it took back). Once per attempt that probes, before its first
  ``metric``.
- ``end``: :class:`EndEvent`

Torch-free and Ray-free: the orchestrator builds ``AttemptSpec``s and reads ``EndEvent``s without importing the
engine.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from contracts.export import ExportTargets
from contracts.recipe import Recipe, recipe_to_dict, validate_recipe_data

EVENT_TYPES = frozenset({"metric", "layer_stats", "anomaly", "checkpoint", "eval", "lr_probe", "end"})
ANOMALY_KINDS = (
    "nonfinite", "loss_scale_collapse", "grad_norm_spike", "loss_spike", "divergence", "oscillation", "stagnation",
    "vanishing_gradients", "skip_escalation",  # the step detectors (workers/detectors)
    # the outcome verdict (workers/verdict.py)
    "vanishing", "never_learned", "stalled", "collapsed", "degraded", "above_bar", "eval_degraded", "overfitting",
    "checkpoint_corrupt",  # the control plane: a checkpoint failed verification (orchestrator/store/checkpoints.py)
)
"""Every ``kind`` an ``anomaly`` event can carry. A ``Finding`` of any other kind is refused when it is made, so
a new kind must be added here, where the API's ``?kind=`` filter learns it."""
CONFIG_ERROR = "config_error"
"""The outcome of an attempt that cannot run as configured: a deterministic setup error (a factory that cannot be
imported or breaks the model/data contract, a setting the engine refuses). Retrying cannot help, so the run fails
at once (no crash restarts); ``reason`` names the field."""
OUTCOMES = ("succeeded", "diverged", "cancelled", CONFIG_ERROR)
"""What an attempt can end as on the worker side (a crash never reaches an ``end`` event)."""


def finite_or_none(x: float | None) -> float | None:
    """A finite float, or None (JSON has no NaN/inf, and a non-finite statistic means "unknown")."""
    return float(x) if x is not None and math.isfinite(x) else None


def one_line(text: Any, limit: int = 300, *, empty: str = "no details") -> str:
    """One line of an error, shortened: the first, or a traceback's last (the exception itself)."""
    lines = [ln.strip() for ln in str(text or "").splitlines() if ln.strip()]
    if not lines:
        return empty
    line = lines[-1] if lines[0].startswith("Traceback") else lines[0]
    return line if len(line) <= limit else line[: limit - 1] + "…"


class SetupConfigError(Exception):
    """Raised by every rank of a Ray Train worker group whose setup hit a deterministic config error, after rank 0
    reported it as a ``config_error`` end event: the group fails at once (no rank waits in a collective for one
    that gave up), and the scheduler knows the failure by this class's name even when no end event arrived."""

    def __init__(self, message: str) -> None:
        self.message = message
        super().__init__(message)

    def __reduce__(self) -> tuple[Any, ...]:  # picklable across Ray's process boundary
        return (type(self), (self.message,))


@dataclass(frozen=True, kw_only=True)
class EndEvent:
    """The ``end`` event: how an attempt ended, as the control plane receives it."""

    outcome: str
    """succeeded | diverged | cancelled | config_error"""
    final_step: int
    """Completed (applied or skipped) steps when the attempt ended."""
    onset_step: int | None = None
    """diverged: the 0-based index of the first anomalous step."""
    detector: str | None = None
    """Kind of the anomaly that ended a diverged attempt."""
    value: float | None = None
    reason: str = ""
    median_grad_norm: float | None = None
    """Median pre-clip grad norm over healthy applied steps (input for clip_to_median_multiple)."""
    loss_scale_collapsed: bool = False
    lr_probe: dict[str, Any] | None = None
    """The ``lr_probe`` event's data when the attempt probed (again here: the end may be ingested first)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EndEvent:
        """Parse a received payload; unknown keys are ignored (newer workers may send more)."""

        def opt_int(key: str) -> int | None:
            v = data.get(key)
            return None if v is None else int(v)

        def opt_float(key: str) -> float | None:
            v = data.get(key)
            return None if v is None else finite_or_none(float(v))

        detector = data.get("detector")
        return cls(
            outcome=str(data.get("outcome", "")),
            final_step=int(data.get("final_step") or 0),
            onset_step=opt_int("onset_step"),
            detector=None if detector is None else str(detector),
            value=opt_float("value"),
            reason=str(data.get("reason") or ""),
            median_grad_norm=opt_float("median_grad_norm"),
            loss_scale_collapsed=bool(data.get("loss_scale_collapsed", False)),
            lr_probe=dict(probe) if isinstance(probe := data.get("lr_probe"), Mapping) else None,
        )


@dataclass(frozen=True)
class ProbePlan:
    """The LR probe an attempt runs before it trains (``recovery.lr_probe``): ``steps`` steps from its start point at
    each candidate LR, the policy's cut LR first; the attempt then trains at the one the probe chose."""

    candidates: tuple[float, ...]
    steps: int
    if_clean: Mapping[str, Any] = field(default_factory=dict)
    """Recipe settings (dotted path → value) the attempt trains with instead of its own when the chosen candidate
    trained its steps cleanly: the warmup this retry added, taken back (``orchestrator/policy/probe.py``)."""
    replay: Mapping[str, Any] = field(default_factory=dict)
    """When set, the first candidate replays the ended attempt: its LR, and here its value (dotted path → value) of
    every setting this retry changes. Chosen cleanly, the attempt trains with all of them: the divergence did not
    recur from the same point at the same settings, so they were not its cause (``orchestrator/policy/probe.py``)."""
    replay_steps: int = 0
    """With ``replay``: the steps the replay trains, through the step that failed (it may need more than ``steps``,
    and fewer would not show the divergence was not the settings')."""
    extend: tuple[float, ...] = ()
    """LRs above every candidate, ascending, each tried (``steps`` steps) only while the highest LR tried so far is
    the best and trained cleanly: a line search upwards after a run that never learned, whose LR may have been far
    too low (``orchestrator/policy/probe.py: upward_lrs``), or the LR between the cut and the one that failed
    (``refine_above``)."""

    def __post_init__(self) -> None:
        if len(self.candidates) < 2 or any(not (math.isfinite(c) and c > 0) for c in self.candidates):
            raise ValueError(f"ProbePlan.candidates: two or more positive LRs, got {self.candidates!r}")
        if self.steps < 1:
            raise ValueError(f"ProbePlan.steps: must be >= 1, got {self.steps}")
        if self.replay and self.replay_steps < 1:
            raise ValueError(f"ProbePlan.replay_steps: must be >= 1 with a replay, got {self.replay_steps}")
        above = all(math.isfinite(c) and c > max(self.candidates) for c in self.extend)
        if not above or list(self.extend) != sorted(self.extend):
            raise ValueError(f"ProbePlan.extend: ascending LRs above every candidate, got {self.extend!r}")

    def steps_of(self, index: int) -> int:
        """Steps the ``index``-th candidate trains: the replay's own count for the first of a replaying plan."""
        return self.replay_steps if self.replay and index == 0 else self.steps

    @property
    def max_steps(self) -> int:
        """The most steps the probe can train: every candidate (the replay at its own count), or the first two and
        every extension. The candidates descend from the highest, and the descent stops once one scores worse than
        one above it (``workers/lr_probe.py: past_the_best``); the extension runs only while the highest LR tried is
        the best, so only when the first beat the second, which ended the descent there."""
        every = sum(self.steps_of(i) for i in range(len(self.candidates)))
        return max(every, self.steps_of(0) + self.steps_of(1) + len(self.extend) * self.steps)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"candidates": list(self.candidates), "steps": self.steps}
        if self.if_clean:
            out["if_clean"] = dict(self.if_clean)
        if self.replay:
            out["replay"] = dict(self.replay)
            out["replay_steps"] = self.replay_steps
        if self.extend:
            out["extend"] = list(self.extend)
        return out

    @classmethod
    def from_plan(cls, plan: Mapping[str, Any] | None) -> ProbePlan | None:
        """The probe an attempt's ``plan`` asks for: None when it asks for none, or when the probe already ran (its
        result, ``chosen``, is in the plan and the attempt's overrides: a relaunch trains at that LR at once)."""
        probe = (plan or {}).get("lr_probe")
        if not probe or probe.get("chosen") is not None:
            return None
        replay = dict(probe.get("replay") or {})
        return cls(candidates=tuple(float(c) for c in probe["candidates"]), steps=int(probe["steps"]),
                   if_clean=dict(probe.get("if_clean") or {}), replay=replay,
                   replay_steps=int(probe.get("replay_steps") or (probe["steps"] if replay else 0)),
                   extend=tuple(float(c) for c in probe.get("extend") or ()))


@dataclass(kw_only=True)
class AttemptSpec:
    """Everything one attempt needs; JSON-able through ``to_dict`` / ``from_dict`` (it travels to Ray workers).

    ``data_offset`` shifts the whole data stream of the attempt: micro-batch index =
    ``(step + data_offset) * grad_accum_steps + micro`` (the recovery policy sets it to skip a bad data window).
    ``rewarm_steps`` re-warms the LR linearly from the resumed step.
    """

    recipe: Recipe
    """The effective recipe (the run's recipe with this attempt's overrides applied)."""
    checkpoint_dir: str
    """Where a plain-process attempt writes ``step_XXXXXXXX`` checkpoints (Ray Train mode: a scratch area)."""
    attempt: int = 1
    resume_from: str | None = None
    """Checkpoint directory (or URI) to resume from; None starts from initialisation."""
    rewarm_steps: int = 0
    data_offset: int = 0
    run_id: int | None = None
    allowed_import_modules: list[str] = field(default_factory=list)
    """The operator's allow-list for custom ``module:function`` models and data (re-checked on the worker)."""
    export: ExportTargets | None = None
    """Where ``telemetry.export`` writes (the server's settings); None: the worker's own ``BALLAST_*`` env."""
    lr_probe: ProbePlan | None = None
    """Probe these LRs before training (``workers/lr_probe.py``); None: train at the recipe's LR."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "recipe": recipe_to_dict(self.recipe),
            "checkpoint_dir": self.checkpoint_dir,
            "attempt": self.attempt,
            "resume_from": self.resume_from,
            "rewarm_steps": self.rewarm_steps,
            "data_offset": self.data_offset,
            "run_id": self.run_id,
            "allowed_import_modules": list(self.allowed_import_modules),
            "export": None if self.export is None else self.export.to_dict(),
            "lr_probe": None if self.lr_probe is None else self.lr_probe.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> AttemptSpec:
        allowed = list(data.get("allowed_import_modules") or [])
        recipe = data["recipe"]
        if not isinstance(recipe, Recipe):
            recipe = validate_recipe_data(recipe, allowed_import_modules=allowed)
        return cls(
            recipe=recipe,
            checkpoint_dir=str(data["checkpoint_dir"]),
            attempt=int(data.get("attempt", 1)),
            resume_from=data.get("resume_from"),
            rewarm_steps=int(data.get("rewarm_steps", 0)),
            data_offset=int(data.get("data_offset", 0)),
            run_id=data.get("run_id"),
            allowed_import_modules=allowed,
            export=ExportTargets.from_dict(data["export"]) if data.get("export") else None,
            lr_probe=ProbePlan.from_plan(data),
        )

    def __post_init__(self) -> None:
        if self.attempt < 1:
            raise ValueError(f"attempt must be >= 1, got {self.attempt}")
        if self.rewarm_steps < 0 or self.data_offset < 0:
            raise ValueError("rewarm_steps and data_offset must be >= 0")


@dataclass(frozen=True)
class SavedCheckpoint:
    step: int
    """Completed steps when it was written (the next step to run on resume)."""
    path: str
    """Local path (plain process) or URI (Ray Train: ``checkpoint_uri_prefix/step_XXXXXXXX``)."""
    healthy: bool
    sha256: str


@dataclass
class AttemptOutcome:
    """How one attempt ended, as the engine saw it: the single shape of an outcome on the worker side.

    ``end()`` is the ``end`` event's payload, the part that crosses to the control plane.
    """

    outcome: str
    """succeeded | diverged | cancelled | config_error"""
    attempt: int
    start_step: int
    final_step: int
    """Completed (applied or skipped) steps when the attempt ended; a rollback step is not completed."""
    onset_step: int | None = None
    detector: str | None = None
    """Kind of the anomaly that ended a diverged attempt (e.g. ``nonfinite``, ``divergence``)."""
    value: float | None = None
    reason: str = ""
    findings: list[dict[str, Any]] = field(default_factory=list)
    """Every anomaly, as its event payload."""
    losses: list[float] = field(default_factory=list)
    """Loss (mean over ranks) of every step observed, from ``start_step`` on (including a rollback step)."""
    grad_norms: list[float] = field(default_factory=list)
    """Pre-clip global grad norm (max over ranks) of every step observed."""
    skipped_steps: list[int] = field(default_factory=list)
    checkpoints: list[SavedCheckpoint] = field(default_factory=list)
    median_grad_norm: float | None = None
    """Median pre-clip grad norm over healthy applied steps (input for clip_to_median_multiple)."""
    loss_scale_collapsed: bool = False
    loss_scales: list[float | None] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    """Every ``eval`` event's payload of the attempt (empty without ``training.eval_interval``)."""
    previous: list[AttemptOutcome] = field(default_factory=list)
    """Earlier attempts run in place in the same worker group (in-place recovery), oldest first."""
    lr_probe: dict[str, Any] | None = None
    """The LR probe the attempt ran before training (the ``lr_probe`` event's data); None: none."""

    def end(self) -> EndEvent:
        """The ``end`` event that reports this outcome to the control plane."""
        return EndEvent(
            outcome=self.outcome,
            final_step=self.final_step,
            onset_step=self.onset_step,
            detector=self.detector,
            value=finite_or_none(self.value),
            reason=self.reason,
            median_grad_norm=self.median_grad_norm,
            loss_scale_collapsed=self.loss_scale_collapsed,
            lr_probe=self.lr_probe,
        )

    def end_event(self) -> dict[str, Any]:
        """The ``end`` event payload as it travels (``end().to_dict()``)."""
        return self.end().to_dict()

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["losses"] = [finite_or_none(x) for x in self.losses]
        out["grad_norms"] = [finite_or_none(x) for x in self.grad_norms]
        out["value"] = finite_or_none(self.value)
        out["previous"] = [p.to_dict() for p in self.previous]
        return out
