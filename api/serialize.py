"""ORM rows (and the store's query results) → response models: one function per shape, shared by the routes and
the event stream."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from api.schemas import AnomalyRead, CheckpointRead, LayerSnapshot, MetricEvent, RunRead, RunSummary
from orchestrator.store.models import AnomalyRow, CheckpointRow, LayerSnapshotRow, MetricPoint, Run

_RUN_KEYS = (
    "id", "name", "owner", "state", "recipe_id", "idempotency_key", "current_attempt", "cancel_requested", "reason",
    "failure_kind", "created_at", "updated_at", "started_at", "ended_at",
)
_SUMMARY_KEYS = ("best_loss", "last_step", "retries_used", "crash_restarts_used")
_ANOMALY_COLUMNS = (
    "id", "run_id", "attempt_id", "seq", "step", "rank", "kind", "detector", "value", "threshold", "action",
    "details", "created_at",
)
_CHECKPOINT_COLUMNS = (
    "id", "run_id", "attempt_id", "step", "uri", "sha256", "healthy", "verdict", "metrics", "deleted", "created_at",
)


def run_read(run: Run, anomalies: dict[str, int], overrides: Mapping[str, Any] | None = None) -> RunRead:
    """ORM run (with its recipe row), its anomaly counts by kind and its current attempt's overrides → RunRead."""
    values = {k: getattr(run, k) for k in (*_RUN_KEYS, *_SUMMARY_KEYS)}
    return RunRead.model_validate(run_fields(values, run.recipe.content_hash, run.recipe.parsed, anomalies, overrides))


def effective(recipe: Mapping[str, Any], overrides: Mapping[str, Any] | None, path: str) -> Any:
    """A recipe field as the current attempt runs it: its override's new value (``{path: [old, new]}``) if it has
    one, else the recipe's."""
    diff = (overrides or {}).get(path)
    if isinstance(diff, list | tuple) and len(diff) == 2:
        return diff[1]
    node: Any = recipe
    for part in path.split("."):
        node = node.get(part) if isinstance(node, Mapping) else None
    return node


def run_fields(
    run: Mapping[str, Any],
    content_hash: str,
    recipe: Mapping[str, Any],
    anomalies: dict[str, int],
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The fields of RunRead from a run's column values, its recipe's hash and normalised JSON, its counts and its
    current attempt's overrides (``max_steps`` is what that attempt trains to, e.g. after a retry with
    ``--set training.max_steps=60``)."""
    max_steps = effective(recipe, overrides, "training.max_steps")
    fields = {k: run[k] for k in _RUN_KEYS}
    fields["content_hash"] = content_hash
    fields["summary"] = RunSummary(
        best_loss=run["best_loss"],
        last_step=run["last_step"],
        max_steps=max_steps if isinstance(max_steps, int) and not isinstance(max_steps, bool) else None,
        retries_used=run["retries_used"],
        crash_restarts_used=run["crash_restarts_used"],
        anomalies_by_kind=anomalies,
        anomalies_total=sum(anomalies.values()),
    )
    return fields


def anomaly_read(row: AnomalyRow, attempt: int) -> AnomalyRead:
    """An anomaly row and its attempt's number → AnomalyRead."""
    return AnomalyRead.model_validate({**{c: getattr(row, c) for c in _ANOMALY_COLUMNS}, "attempt": attempt})


def checkpoint_read(row: CheckpointRow, attempt: int) -> CheckpointRead:
    """A checkpoint row and its attempt's number → CheckpointRead."""
    return CheckpointRead.model_validate({**{c: getattr(row, c) for c in _CHECKPOINT_COLUMNS}, "attempt": attempt})


def layer_snapshot(row: LayerSnapshotRow, attempt: int) -> LayerSnapshot:
    """A layer-snapshot row and its attempt's number → LayerSnapshot."""
    return LayerSnapshot.model_validate({
        "attempt": attempt, "step": row.step, "block_grad_norms": list(row.block_grad_norms or []),
        "layer_grad_norms": dict(row.layer_grad_norms or {}), "update_ratio": row.update_ratio,
        "diagnosis": row.diagnosis,
    })


def metric_event(point: MetricPoint, attempt: int) -> MetricEvent:
    """A metric row and its attempt's number → the SSE ``metric`` payload."""
    return MetricEvent(
        attempt=attempt, step=point.step, loss=point.loss, grad_norm=point.grad_norm,
        grad_norm_clipped=point.grad_norm_clipped, lr=point.lr, loss_scale=point.loss_scale,
        throughput=point.throughput, skipped=point.skipped,
    )
