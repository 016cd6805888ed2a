"""Request and response schemas of the REST API, apart from the ORM (``orchestrator/store/models.py``).

Response models are built from ORM rows with ``model_validate(row, from_attributes=True)``. Floats that can be
non-finite (a NaN loss is exactly what a reader is looking for) are written as the strings ``"NaN"``,
``"Infinity"`` and ``"-Infinity"`` rather than silently becoming ``null``; ``float(value)`` in Python reads both.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema

from contracts.recipe import Recipe
from orchestrator.policy.states import AttemptState, FailureKind, RunState

T = TypeVar("T")


def _recipe_field_pattern(name: str) -> str:
    """The regex the recipe schema itself puts on field ``name``."""
    return next(str(m.pattern) for m in Recipe.model_fields[name].metadata if getattr(m, "pattern", None))


RUN_NAME_PATTERN = _recipe_field_pattern("name")
"""A run is named by its recipe: the same rule."""
PRINCIPAL_PATTERN = r"^[A-Za-z0-9._@-]+$"
"""Who owns runs and tokens: a token's name and the principal it acts as."""

NonFinite = Literal["NaN", "Infinity", "-Infinity"]


def _float_or_tag(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return v


def _json_safe(v: Any) -> Any:
    """Replace non-finite floats anywhere in a JSON-like value (stored blobs may hold them)."""
    if isinstance(v, float):
        return _float_or_tag(v)
    if isinstance(v, dict):
        return {str(k): _json_safe(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_json_safe(x) for x in v]
    return v


Number = Annotated[
    float | NonFinite,
    BeforeValidator(_float_or_tag),
    WithJsonSchema(
        {
            "anyOf": [{"type": "number"}, {"type": "string", "enum": ["NaN", "Infinity", "-Infinity"]}],
            "description": "A number; non-finite values as the strings NaN, Infinity, -Infinity.",
        }
    ),
]
JsonObject = Annotated[dict[str, Any], BeforeValidator(_json_safe)]
RecipeDoc = Annotated[
    dict[str, Any],
    WithJsonSchema({"allOf": [{"$ref": "#/components/schemas/Recipe"}]}),
]
"""A normalised recipe (every default filled); its schema is the recipe schema itself."""


class _Read(BaseModel):
    model_config = ConfigDict(from_attributes=True)


# ------------------------------------------------------------------------------------------------ problems
class FieldErrorOut(BaseModel):
    """One invalid field: its dotted path (``optimizer.lr``, ``query.limit``), the problem, and its YAML line."""

    path: str = Field(examples=["optimizer.lr"])
    message: str = Field(examples=["Input should be greater than 0"])
    line: int | None = Field(default=None, examples=[12])


class Problem(BaseModel):
    """An RFC 9457 problem document (``application/problem+json``)."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "type": "urn:ballast:problem:invalid-recipe",
                    "title": "Invalid recipe",
                    "status": 422,
                    "detail": "the recipe is invalid",
                    "instance": "/api/v1/runs",
                    "errors": [{"path": "optimizer.lr", "message": "Input should be greater than 0", "line": 9}],
                }
            ]
        }
    )

    type: str = Field(description="A URI naming the kind of problem (`about:blank`: see the status).")
    title: str = Field(description="Short summary of the kind of problem.")
    status: int = Field(ge=100, le=599, description="The HTTP status code.")
    detail: str | None = Field(default=None, description="What went wrong in this occurrence.")
    instance: str | None = Field(default=None, description="The request path.")
    errors: list[FieldErrorOut] | None = Field(default=None, description="Field-level errors of invalid input.")


# ------------------------------------------------------------------------------------------------- recipes
class RecipeValidation(BaseModel):
    """A recipe that passed validation, normalised (defaults filled), with warnings about legal-but-odd settings."""

    recipe: RecipeDoc
    warnings: list[str] = Field(description="Settings that are legal but probably not what the author wants.")
    content_hash: str = Field(
        pattern=r"^[0-9a-f]{64}$", description="SHA-256 of the normalised recipe (canonical JSON)."
    )


# ---------------------------------------------------------------------------------------------------- runs
class RunSummary(BaseModel):
    """How the run is going, at a glance."""

    best_loss: Number | None = Field(default=None, description="Lowest loss seen so far.")
    last_step: int | None = Field(default=None, description="Newest step reported (0-based).")
    max_steps: int | None = Field(
        default=None,
        description="training.max_steps the current attempt trains to (the recipe's, or a retry's override).",
    )
    retries_used: int = Field(description="Numeric-divergence retries used.")
    crash_restarts_used: int = Field(description="Crash restarts used.")
    anomalies_by_kind: dict[str, int] = Field(description="Anomaly counts by kind, across attempts.")
    anomalies_total: int


class RunRead(_Read):
    """A run as listed and as returned on submission."""

    id: int
    name: str
    owner: str
    state: RunState
    recipe_id: int
    content_hash: str = Field(description="SHA-256 of the normalised recipe.")
    idempotency_key: str | None
    current_attempt: int = Field(description="Number of the newest attempt (0 before the first one starts).")
    cancel_requested: bool = Field(description="A cancel was requested; the scheduler is stopping the run.")
    reason: str | None = Field(description="Why the run is in its state (the last transition's reason).")
    failure_kind: FailureKind | None = Field(
        default=None,
        description="A failed run's kind of failure: `config_error` (the recipe cannot run as written: a setup "
        "error no retry fixes; `reason` names the field), `gave_up` (the recovery policy gave up), "
        "`start_failed` (the attempt could not start), `lost`; null unless failed.",
    )
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None
    ended_at: datetime | None
    summary: RunSummary


class AttemptRead(_Read):
    """One try at a run, with the settings it ran with (as a diff against the recipe)."""

    id: int
    run_id: int
    number: int = Field(description="1-based attempt number within the run.")
    state: AttemptState
    kind: str = Field(description="initial | numeric_retry | crash_restart | manual", examples=["numeric_retry"])
    parent_checkpoint_id: int | None = Field(description="The checkpoint it resumed from.")
    resume_step: int
    overrides: JsonObject = Field(
        description='Effective settings as a diff against the recipe: `{"optimizer.lr": [old, new]}`.',
        examples=[{"optimizer.lr": [0.003, 0.0015]}],
    )
    plan: JsonObject = Field(description="Instructions for the workers: rewarm_steps, data_offset, resume_uri; for "
                             "a retry that probes its LR, lr_probe (its candidates, and once run, what it chose).")
    reason: str | None
    outcome: JsonObject | None = Field(description="How it ended: onset_step, detector, value, final_step, error.")
    onset_step: int | None
    last_step: int | None
    created_at: datetime
    started_at: datetime | None
    ended_at: datetime | None


class RunDetail(RunRead):
    """A run with its current attempt and its normalised recipe."""

    attempt: AttemptRead | None = Field(description="The current (newest) attempt, if any.")
    recipe: RecipeDoc


class RunCancel(BaseModel):
    """Result of a cancel request."""

    run: RunRead
    immediate: bool = Field(
        description="True: the run was queued and is now cancelled. False: it is active and the scheduler "
        "will stop it (`run.cancel_requested`)."
    )


class RetryRequest(BaseModel):
    """Manual retry of a failed or cancelled run."""

    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"overrides": {"optimizer.lr": 0.001, "clipping.max_norm": 0.5}}]},
    )

    overrides: dict[str, Any] = Field(
        default_factory=dict,
        description="Dotted recipe paths and their new values for the retry; validated against the recipe "
        "schema. The retry also keeps the previous attempt's tightened settings.",
    )


class RetryResult(BaseModel):
    run: RunRead
    attempt: AttemptRead


# ------------------------------------------------------------------------------------- anomalies, checkpoints
class AnomalyRead(_Read):
    id: int
    run_id: int
    attempt_id: int
    attempt: int = Field(description="Attempt number.")
    seq: int = Field(description="Sequence number of the event within the attempt.")
    step: int
    rank: int
    kind: str = Field(examples=["grad_norm_spike"])
    detector: str
    value: Number | None
    threshold: Number | None
    action: str = Field(examples=["rollback"])
    details: JsonObject
    created_at: datetime


class CheckpointRead(_Read):
    id: int
    run_id: int
    attempt_id: int
    attempt: int = Field(description="Attempt number.")
    step: int
    uri: str
    sha256: str
    healthy: bool
    verdict: JsonObject = Field(description="Why healthy or not: weights_finite, anomalies_since_previous, ...")
    metrics: JsonObject
    deleted: bool = Field(description="Removed by the retention rule; kept here for the record.")
    created_at: datetime


# -------------------------------------------------------------------------------------------------- metrics
MetricName = Literal["loss", "grad_norm", "grad_norm_clipped", "lr", "loss_scale", "throughput", "eval_loss",
                     "skipped"]
"""``eval_loss`` (with ``training.eval_interval``) is sparse, and its steps count completed steps (the weights after
that many updates, like a checkpoint's step) where the others' are the 0-based index of the step. ``skipped`` is
sparse too: the steps whose update was discarded, each with the value 1."""


class MetricSeries(BaseModel):
    """One metric over steps, in (attempt, step) order; parallel arrays."""

    name: MetricName
    steps: list[int]
    values: list[Number]
    attempts: list[int] = Field(description="Attempt number of each point (steps repeat after a rollback).")
    total_points: int = Field(description="Points in range before downsampling.")
    downsampled: bool = Field(description="True when each bucket was reduced to its min and max.")


class MetricsRead(BaseModel):
    run_id: int
    max_points: int
    series: list[MetricSeries]


# --------------------------------------------------------------------------------------------------- events
class StateEvent(_Read):
    """A state change of the run or one of its attempts (SSE ``event: state``)."""

    id: int
    run_id: int
    attempt_id: int | None
    entity: Literal["run", "attempt"]
    from_state: str | None
    to_state: str
    reason: str | None
    data: JsonObject
    created_at: datetime


class MetricEvent(BaseModel):
    """The newest per-step metrics (SSE ``event: metric``); intermediate steps between polls are skipped."""

    attempt: int
    step: int
    loss: Number | None
    grad_norm: Number | None
    grad_norm_clipped: Number | None
    lr: Number | None
    loss_scale: Number | None
    throughput: Number | None
    skipped: bool


class EvalEvent(BaseModel):
    """A held-out loss (SSE ``event: eval``): every one is sent (they are sparse). ``step`` counts completed steps,
    like a checkpoint's."""

    attempt: int
    step: int
    eval_loss: Number | None


# --------------------------------------------------------------------------------------------------- tokens
Scope = Literal["read", "submit", "admin"]


class TokenCreate(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"name": "ci", "principal": "team-a", "scopes": ["read", "submit"]}]},
    )

    name: str = Field(min_length=1, max_length=100, pattern=PRINCIPAL_PATTERN)
    principal: str | None = Field(
        default=None, min_length=1, max_length=100, pattern=PRINCIPAL_PATTERN,
        description="Who the token acts as (owns the runs it submits); defaults to `name`.",
    )
    scopes: list[Scope] = Field(min_length=1, max_length=3)


class TokenRead(_Read):
    id: int
    name: str
    principal: str
    scopes: list[str]
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None


class TokenCreated(TokenRead):
    token: str = Field(description="The bearer token. Shown once: only its hash is stored.")


# ---------------------------------------------------------------------------------------------------- pages
class Page(BaseModel, Generic[T]):
    """A page of a listing in a stable order; pass ``next`` back as ``cursor`` for the following page."""

    data: list[T]
    count: int = Field(description="Items matching the filters, across all pages.")
    next: str | None = Field(description="Cursor of the next page; null on the last page.")


# --------------------------------------------------------------------------------------------------- health
class Health(BaseModel):
    status: Literal["ok"]


class Readiness(BaseModel):
    status: Literal["ok", "unavailable"]
    checks: dict[str, str] = Field(description="Each dependency: `ok`, `skipped` or the error.")


# --------------------------------------------------------------------------------------------------- layers
class LayerSnapshot(BaseModel):
    """Per-layer gradient norms of one attempt at one step (the workers' ``layer_stats`` event)."""

    attempt: int = Field(description="Attempt number.")
    step: int = Field(description="The step the norms were measured at (0-based).")
    block_grad_norms: list[Number | None] = Field(
        description="Gradient norm of each block of the model, input → output (`model.blocks` order)."
    )
    layer_grad_norms: dict[str, Number | None] = Field(description="Gradient norm of each named parameter.")
    update_ratio: Number | None = Field(description="Largest update-to-weight ratio of the step.")
    diagnosis: str | None = Field(description="What the depth profile suggests, e.g. `vanishing with depth`.")
