"""Worker events → store rows, idempotently.

The event channel may deliver an event twice (a scheduler that died after reading a batch but before committing
it reads the batch again after a restart), so every row is keyed by a natural unique constraint and inserted
with ``ON CONFLICT DO NOTHING`` (metric points per (attempt, step), anomalies per (attempt, seq), checkpoints per
(attempt, step)); run and attempt aggregates are maxima/minima, so applying a batch twice changes nothing.

Where things go:

- ``metric`` → ``metric_points``, downsampled to every ``metrics_every_steps``-th step for long runs; skipped
  steps, non-finite losses, steps with an anomaly in the same batch and the attempt's final step are always kept.
- ``anomaly`` → ``anomalies``; ``checkpoint`` → ``checkpoints`` (with the health verdict).
- ``layer_stats`` → the newest snapshot per attempt in ``attempts.ray_info["layer_stats"]``: the per-layer
  profile is a diagnosis aid (its findings arrive as anomalies), and a row per layer per k steps would outgrow
  the metric table for no reader.
- ``end`` → ``attempts.outcome`` / ``onset_step`` / ``last_step``. State changes are the scheduler's job (it
  decides what an outcome means for the run), never ingestion's.

Non-finite floats (a NaN loss is exactly what Ballast exists to record) are stored as NULL in float columns
(SQLite cannot hold NaN, and JSON responses cannot carry it) and as the strings "NaN"/"Infinity"/"-Infinity"
inside JSON columns, which PostgreSQL's ``json`` type would otherwise refuse.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from orchestrator.store.models import AnomalyRow, Attempt, CheckpointRow, MetricPoint, Run


@dataclass
class IngestResult:
    """What one call wrote (new rows only) and whether the batch closed the attempt."""

    metrics: int = 0
    anomalies: int = 0
    checkpoints: int = 0
    end: dict[str, Any] | None = None
    """The ``end`` event's data, when the batch held one."""
    max_seq: int = 0
    steps: list[int] = field(default_factory=list)


def finite_or_none(x: Any) -> float | None:
    """A float column value: None for missing or non-finite numbers."""
    if x is None or isinstance(x, bool):
        return None
    try:
        f = float(x)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def jsonable(x: Any) -> Any:
    """A JSON column value: non-finite floats become the strings JSON itself lacks."""
    if isinstance(x, float) and not math.isfinite(x):
        return "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    return x


def _insert(session: Session, table: Any) -> Any:
    """The dialect's INSERT that supports ``on_conflict_do_nothing`` (SQLite and PostgreSQL spell it alike)."""
    name = session.get_bind().dialect.name
    if name == "postgresql":
        return postgresql.insert(table)
    if name == "sqlite":
        return sqlite.insert(table)
    raise NotImplementedError(f"database dialect {name!r} is not supported (SQLite or PostgreSQL)")


def _insert_ignore(session: Session, table: Any, keys: Sequence[str], rows: list[dict[str, Any]]) -> int:
    if not rows:
        return 0
    # RETURNING counts what was new on both backends (a driver's executemany rowcount is not reliable)
    stmt = _insert(session, table).on_conflict_do_nothing(index_elements=list(keys)).returning(table.c.id)
    return len(session.execute(stmt, rows).all())


def _int(x: Any, default: int = 0) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return default


def ingest_events(
    *,
    session: Session,
    run: Run,
    attempt: Attempt,
    events: Iterable[Mapping[str, Any]],
    metrics_every_steps: int = 1,
) -> IngestResult:
    """Write one attempt's events (any order, possibly redelivered) and update the aggregates. Flushes only."""
    if metrics_every_steps < 1:
        raise ValueError(f"metrics_every_steps: must be >= 1, got {metrics_every_steps}")
    evs = sorted(events, key=lambda e: _int(e.get("seq")))
    res = IngestResult()
    if not evs:
        return res
    res.max_seq = max(_int(e.get("seq")) for e in evs)
    anomaly_steps = {_int(e["data"].get("step"), -1) for e in evs if e.get("type") == "anomaly"}
    end = next((dict(e["data"]) for e in reversed(evs) if e.get("type") == "end"), None)
    final_step = _int(end.get("final_step"), -1) if end is not None else -1

    metric_rows: list[dict[str, Any]] = []
    anomaly_rows: list[dict[str, Any]] = []
    checkpoint_rows: list[dict[str, Any]] = []
    best: float | None = None
    last_step: int | None = None
    layer_stats: dict[str, Any] | None = None
    for ev in evs:
        kind, data = ev.get("type"), ev.get("data") or {}
        step = data.get("step")
        if step is not None:
            last_step = max(last_step if last_step is not None else -1, _int(step))
        if kind == "metric":
            step_i = _int(step)
            loss = finite_or_none(data.get("loss"))
            skipped = bool(data.get("skipped", False))
            if loss is not None and not skipped:
                best = loss if best is None else min(best, loss)
            keep = (
                step_i % metrics_every_steps == 0
                or skipped
                or loss is None
                or step_i in anomaly_steps
                or step_i == final_step
            )
            if keep:
                metric_rows.append(
                    {
                        "run_id": run.id,
                        "attempt_id": attempt.id,
                        "step": step_i,
                        "loss": loss,
                        "grad_norm": finite_or_none(data.get("grad_norm")),
                        "grad_norm_clipped": finite_or_none(data.get("grad_norm_clipped")),
                        "lr": finite_or_none(data.get("lr")),
                        "loss_scale": finite_or_none(data.get("loss_scale")),
                        "throughput": finite_or_none(data.get("throughput")),
                        "skipped": skipped,
                    }
                )
        elif kind == "anomaly":
            details = dict(jsonable(data.get("details") or {}))
            for key in ("value", "threshold"):
                raw = data.get(key)
                if raw is not None and finite_or_none(raw) is None:
                    details.setdefault(key, jsonable(raw))
            anomaly_rows.append(
                {
                    "run_id": run.id,
                    "attempt_id": attempt.id,
                    "seq": _int(ev.get("seq")),
                    "step": _int(step),
                    "rank": _int(data.get("rank")),
                    "kind": str(data.get("kind", "unknown"))[:40],
                    "detector": str(data.get("detector", data.get("kind", "unknown")))[:40],
                    "value": finite_or_none(data.get("value")),
                    "threshold": finite_or_none(data.get("threshold")),
                    "action": str(data.get("action", "record"))[:16],
                    "details": details,
                }
            )
        elif kind == "checkpoint":
            checkpoint_rows.append(
                {
                    "run_id": run.id,
                    "attempt_id": attempt.id,
                    "step": _int(step),
                    "uri": str(data.get("uri", "")),
                    "sha256": str(data.get("sha256", ""))[:64],
                    "healthy": bool(data.get("healthy", False)),
                    "verdict": jsonable(data.get("verdict") or {}),
                    "metrics": jsonable(data.get("metrics") or {}),
                }
            )
        elif kind == "layer_stats":
            if layer_stats is None or _int(step) >= _int(layer_stats.get("step")):
                layer_stats = dict(jsonable(data))

    res.metrics = _insert_ignore(session, MetricPoint.__table__, ("attempt_id", "step"), metric_rows)
    res.anomalies = _insert_ignore(session, AnomalyRow.__table__, ("attempt_id", "seq"), anomaly_rows)
    res.checkpoints = _insert_ignore(session, CheckpointRow.__table__, ("attempt_id", "step"), checkpoint_rows)
    res.steps = sorted({r["step"] for r in metric_rows})

    if end is not None:
        last_step = max(last_step if last_step is not None else -1, final_step) if final_step >= 0 else last_step
        attempt.outcome = jsonable(end)
        onset = end.get("onset_step")
        attempt.onset_step = _int(onset) if onset is not None else None
        res.end = end
    if layer_stats is not None:
        current = (attempt.ray_info or {}).get("layer_stats") or {}
        if _int(layer_stats.get("step")) >= _int(current.get("step"), -1):
            attempt.ray_info = {**(attempt.ray_info or {}), "layer_stats": layer_stats}
    if last_step is not None and last_step >= 0:
        attempt.last_step = last_step if attempt.last_step is None else max(attempt.last_step, last_step)
        if attempt.number >= run.current_attempt:
            # the run is where its newest attempt is (a rollback moves it back)
            run.last_step = attempt.last_step
    if best is not None:
        run.best_loss = best if run.best_loss is None else min(run.best_loss, best)
    attempt.last_seq = max(attempt.last_seq or 0, res.max_seq)
    session.flush()
    return res
