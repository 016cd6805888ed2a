"""The data-access functions in one import (``from orchestrator.store import repo``), as the API uses them.

Each lives in the module of its concern: ``runs`` (submit, read, list), ``actions`` (cancel, manual retry),
``queries`` (a run's children and what the live stream polls), ``tokens``, ``transitions`` (state changes and
the audit log), ``paging`` (cursors). They take keyword arguments and only ``add``/``flush``: the caller owns the
transaction. State changes of runs and attempts go through ``set_run_state`` / ``set_attempt_state`` only.
"""

from __future__ import annotations

from orchestrator.store.actions import (
    MANUAL_RETRY_KIND,
    RECOVERY_KINDS,
    cancel_queued_run,
    request_cancel,
    request_retry,
)
from orchestrator.store.paging import BadCursor, PageResult
from orchestrator.store.queries import (
    METRIC_SERIES,
    Series,
    anomalies_after,
    anomaly_counts,
    current_overrides,
    downsample_min_max,
    get_attempt,
    list_anomalies,
    list_attempts,
    list_checkpoints,
    list_layer_snapshots,
    metric_series,
    newest_metric_after,
    state_changes_after,
)
from orchestrator.store.runs import (
    OVERVIEW_ATTEMPT_COLUMNS,
    OVERVIEW_RUN_COLUMNS,
    RunOverview,
    content_hash,
    create_recipe,
    create_run,
    get_run,
    get_run_by_idempotency_key,
    get_run_overview,
    list_runs,
    read_run_overview,
)
from orchestrator.store.tokens import create_token, get_token_by_hash, list_tokens, revoke_token
from orchestrator.store.transitions import apply_transitions, set_attempt_state, set_run_state

__all__ = [
    "MANUAL_RETRY_KIND", "METRIC_SERIES", "OVERVIEW_ATTEMPT_COLUMNS", "OVERVIEW_RUN_COLUMNS", "RECOVERY_KINDS",
    "BadCursor", "PageResult", "RunOverview", "Series", "anomalies_after", "anomaly_counts", "apply_transitions",
    "cancel_queued_run", "content_hash", "create_recipe", "create_run", "create_token", "current_overrides",
    "downsample_min_max", "get_attempt", "get_run", "get_run_by_idempotency_key", "get_run_overview",
    "get_token_by_hash",
    "list_anomalies", "list_attempts", "list_checkpoints", "list_layer_snapshots", "list_runs", "list_tokens",
    "metric_series",
    "newest_metric_after", "read_run_overview", "request_cancel", "request_retry", "revoke_token",
    "set_attempt_state", "set_run_state",
    "state_changes_after",
]
