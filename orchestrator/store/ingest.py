"""Worker events → store rows, idempotently.

The event channel may deliver an event twice (a scheduler that died after reading a batch but before committing
it reads the batch again after a restart), so every row is keyed by a natural unique constraint and inserted
with ``ON CONFLICT DO NOTHING`` (metric points, eval points, layer snapshots and checkpoints per (attempt, step),
anomalies per (attempt, seq)); run and attempt aggregates are maxima/minima, so applying a batch twice changes nothing.
Each table's rows of a batch go in as one statement: on PostgreSQL the high-volume metric and eval points and the
layer snapshots as one ``INSERT ... SELECT FROM unnest(arrays)`` (``_insert_unnest``), elsewhere a multi-row
``INSERT ... VALUES``; ``ingest_many`` writes the batches of many attempts (the scheduler's whole tick) with one
statement per table.

Where things go:

- ``metric`` → ``metric_points``, downsampled to every ``metrics_every_steps``-th step for long runs; skipped
  steps, non-finite losses, steps with an anomaly in the same batch and the attempt's final step are always kept.
- ``anomaly`` → ``anomalies``; ``checkpoint`` → ``checkpoints`` (with the health verdict).
- ``eval`` → ``eval_points`` per (attempt, step), never downsampled (one per ``training.eval_interval`` steps).
- ``layer_stats`` → ``layer_snapshots`` per (attempt, step), every one of them: the dashboard draws the per-layer
  profile over time (a step × depth heat map), and a row is one event per ``telemetry.layer_stats_every`` steps.
- ``lr_probe`` → the attempt's LR override becomes the LR the probe chose, its ``plan.lr_probe`` keeps the result
  and its reason says what was chosen (``orchestrator/policy/probe.py``): what the attempt really trains at, so
  the next retry tightens from it and a crash restart resumes at it.
- ``end`` → ``attempts.outcome`` / ``onset_step`` / ``last_step``. State changes are the scheduler's job (it
  decides what an outcome means for the run), never ingestion's.

Non-finite floats (a NaN loss is exactly what Ballast exists to record) are stored as NULL in float columns
(SQLite cannot hold NaN, and JSON responses cannot carry it) and as the strings "NaN"/"Infinity"/"-Infinity"
inside JSON columns, which PostgreSQL's ``json`` type would otherwise refuse.
"""

from __future__ import annotations

import functools
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from contracts.wire import finite_or_none
from orchestrator.policy.probe import apply_probe_result
from orchestrator.store.models import (
    AnomalyRow,
    Attempt,
    CheckpointRow,
    EvalPoint,
    LayerSnapshotRow,
    MetricPoint,
    Run,
    utcnow,
)


@dataclass
class IngestResult:
    """What one call wrote (new rows only) and whether the batch closed the attempt."""

    metrics: int = 0
    anomalies: int = 0
    checkpoints: int = 0
    evals: int = 0
    layers: int = 0
    end: dict[str, Any] | None = None
    """The ``end`` event's data, when the batch held one."""
    max_seq: int = 0
    steps: list[int] = field(default_factory=list)


def number_or_none(x: Any) -> float | None:
    """A float column value: None for missing, non-numeric (bools included) or non-finite values."""
    if x is None or isinstance(x, bool):
        return None
    try:
        return finite_or_none(float(x))
    except (TypeError, ValueError):
        return None


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


def _insert_ignore(session: Session, table: Any, keys: Sequence[str], rows: list[dict[str, Any]]) -> Counter[int]:
    """Insert what is new; returns how many rows went in per ``attempt_id``."""
    if not rows:
        return Counter()
    attempts = {r["attempt_id"] for r in rows}
    if session.get_bind().dialect.name == "postgresql" and table.name in _UNNEST_TABLES:
        return _insert_unnest(session, table, keys, rows, attempts)
    # RETURNING counts what was new on both backends (a driver's executemany rowcount is not reliable)
    stmt = _insert(session, table).on_conflict_do_nothing(index_elements=list(keys)).returning(table.c.attempt_id)
    return Counter(int(a) for a in session.execute(stmt, rows).scalars())


_UNNEST_TABLES = frozenset({"metric_points", "eval_points", "layer_snapshots"})
"""The high-volume tables: on PostgreSQL a batch goes in as one array per column (a JSON column as an array of its
texts, ``json[]``)."""


def _insert_unnest(session: Session, table: Any, keys: Sequence[str], rows: list[dict[str, Any]],
                   attempts: set[int]) -> Counter[int]:
    """One ``INSERT ... SELECT FROM unnest(col arrays) ON CONFLICT DO NOTHING`` for the whole batch.

    The statement's text is the same for every batch (one bound array per column), so the driver converts it
    once and the server prepares it once; the multi-row ``VALUES`` of the generic path is a new text per batch
    size, re-parsed each time (about half of an ingest's time went there). A single statement's rowcount is what
    it inserted (a conflicting row, redelivered or repeated within the batch, is not counted). Rows of several
    attempts (``ingest_many``) go in as one statement too, which then returns the ``attempt_id`` of each row it
    inserted, to count them per attempt.
    """
    columns = [c for c in rows[0] if c != "created_at"]
    sql = _unnest_sql(table, tuple(columns), tuple(keys), len(attempts) > 1)
    params: dict[str, Any] = {
        c: [json.dumps(r[c], allow_nan=False) for r in rows] if isinstance(table.c[c].type, sa.JSON)
        else [r[c] for r in rows]
        for c in columns
    }
    params["created_at"] = utcnow()  # one stamp for the batch (the ORM default gave each row its own)
    result = session.execute(sql, params)
    if len(attempts) > 1:
        return Counter(int(a) for a in result.scalars())
    return Counter({next(iter(attempts)): int(result.rowcount or 0)})  # type: ignore[attr-defined]


@functools.cache
def _unnest_sql(table: Any, columns: tuple[str, ...], keys: tuple[str, ...], returning: bool) -> sa.TextClause:
    dialect = postgresql.dialect()  # type: ignore[no-untyped-call]
    arrays = ", ".join(f"CAST(:{c} AS {table.c[c].type.compile(dialect=dialect)}[])" for c in columns)
    return sa.text(
        f"INSERT INTO {table.name} ({', '.join(columns)}, created_at) "
        f"SELECT u.*, CAST(:created_at AS TIMESTAMP WITH TIME ZONE) FROM unnest({arrays}) AS u "
        f"ON CONFLICT ({', '.join(keys)}) DO NOTHING" + (" RETURNING attempt_id" if returning else "")
    )


def _int(x: Any, default: int = 0) -> int:
    try:
        return int(x)
    except (TypeError, ValueError):
        return default


@dataclass
class _Rows:
    """One batch turned into rows and aggregates, before anything is written."""

    run_id: int
    attempt_id: int
    metrics_every_steps: int
    anomaly_steps: set[int]
    """Steps with an anomaly in this batch: their metric points are always kept."""
    final_step: int
    """The attempt's final step, when the batch ends it (else -1): always kept."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    anomalies: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)
    evals: list[dict[str, Any]] = field(default_factory=list)
    best: float | None = None
    last_step: int | None = None
    layers: list[dict[str, Any]] = field(default_factory=list)
    probe: dict[str, Any] | None = None
    """The ``lr_probe`` event's data, when the batch held one."""

    def add(self, ev: Mapping[str, Any]) -> None:
        kind, data = ev.get("type"), ev.get("data") or {}
        step = data.get("step")
        if step is not None:
            self.last_step = max(self.last_step if self.last_step is not None else -1, _int(step))
        if kind == "metric":
            self._metric(data)
        elif kind == "anomaly":
            self._anomaly(_int(ev.get("seq")), data)
        elif kind == "checkpoint":
            self._checkpoint(data)
        elif kind == "eval":
            self.evals.append({"run_id": self.run_id, "attempt_id": self.attempt_id, "step": _int(step),
                               "eval_loss": number_or_none(data.get("eval_loss"))})
        elif kind == "layer_stats":
            self._layers(data)
        elif kind == "lr_probe":
            self.probe = dict(data)

    def _metric(self, data: Mapping[str, Any]) -> None:
        step = _int(data.get("step"))
        loss = number_or_none(data.get("loss"))
        skipped = bool(data.get("skipped", False))
        if loss is not None and not skipped:
            self.best = loss if self.best is None else min(self.best, loss)
        keep = (
            step % self.metrics_every_steps == 0
            or skipped
            or loss is None
            or step in self.anomaly_steps
            or step == self.final_step
        )
        if keep:
            self.metrics.append({
                "run_id": self.run_id,
                "attempt_id": self.attempt_id,
                "step": step,
                "loss": loss,
                **{k: number_or_none(data.get(k))
                   for k in ("grad_norm", "grad_norm_clipped", "lr", "loss_scale", "throughput")},
                "skipped": skipped,
            })

    def _layers(self, data: Mapping[str, Any]) -> None:
        blocks, layers, diagnosis = data.get("block_grad_norms"), data.get("layer_grad_norms"), data.get("diagnosis")
        self.layers.append({
            "run_id": self.run_id,
            "attempt_id": self.attempt_id,
            "step": _int(data.get("step")),
            "block_grad_norms": jsonable(list(blocks)) if isinstance(blocks, list | tuple) else [],
            "layer_grad_norms": jsonable(dict(layers)) if isinstance(layers, Mapping) else {},
            "update_ratio": number_or_none(data.get("update_ratio")),
            "diagnosis": str(diagnosis)[:200] if diagnosis else None,
        })

    def _anomaly(self, seq: int, data: Mapping[str, Any]) -> None:
        details = dict(jsonable(data.get("details") or {}))
        for key in ("value", "threshold"):
            raw = data.get(key)
            if raw is not None and number_or_none(raw) is None:
                details.setdefault(key, jsonable(raw))
        self.anomalies.append({
            "run_id": self.run_id,
            "attempt_id": self.attempt_id,
            "seq": seq,
            "step": _int(data.get("step")),
            "rank": _int(data.get("rank")),
            "kind": str(data.get("kind", "unknown"))[:40],
            "detector": str(data.get("detector", data.get("kind", "unknown")))[:40],
            "value": number_or_none(data.get("value")),
            "threshold": number_or_none(data.get("threshold")),
            "action": str(data.get("action", "record"))[:16],
            "details": details,
        })

    def _checkpoint(self, data: Mapping[str, Any]) -> None:
        self.checkpoints.append({
            "run_id": self.run_id,
            "attempt_id": self.attempt_id,
            "step": _int(data.get("step")),
            "uri": str(data.get("uri", "")),
            "sha256": str(data.get("sha256", ""))[:64],
            "healthy": bool(data.get("healthy", False)),
            "verdict": jsonable(data.get("verdict") or {}),
            "metrics": jsonable(data.get("metrics") or {}),
        })


def ingest_events(
    *,
    session: Session,
    run: Run,
    attempt: Attempt,
    events: Iterable[Mapping[str, Any]],
    metrics_every_steps: int = 1,
) -> IngestResult:
    """Write one attempt's events (any order, possibly redelivered) and update the aggregates. Flushes only."""
    return ingest_many(session=session, batches=[(run, attempt, events)], metrics_every_steps=metrics_every_steps)[0]


def ingest_many(
    *,
    session: Session,
    batches: Sequence[tuple[Run, Attempt, Iterable[Mapping[str, Any]]]],
    metrics_every_steps: int = 1,
) -> list[IngestResult]:
    """``ingest_events`` for several attempts (of one run or of many) at once: each table's new rows of all the
    batches go in as one statement, then the aggregates are updated batch by batch, in the order given (an
    attempt's aggregates after its earlier attempts', as one call each would). One result per batch. Flushes only.

    An attempt must appear in one batch at most (the counts are per attempt)."""
    if metrics_every_steps < 1:
        raise ValueError(f"metrics_every_steps: must be >= 1, got {metrics_every_steps}")
    attempt_ids = [attempt.id for _, attempt, _ in batches]
    if len(set(attempt_ids)) != len(attempt_ids):
        raise ValueError("ingest_many: an attempt appears in more than one batch")
    prepared = [_prepare(run, attempt, events, metrics_every_steps) for run, attempt, events in batches]
    live = [p for p in prepared if p is not None]
    for name, table in _TABLES:  # IngestResult and _Rows name each table's rows alike
        keys = ("attempt_id", "seq") if name == "anomalies" else ("attempt_id", "step")
        counts = _insert_ignore(session, table, keys, [row for _, rows, _ in live for row in getattr(rows, name)])
        for res, rows, _ in live:
            setattr(res, name, counts.get(rows.attempt_id, 0))
    results = []
    for (run, attempt, _), p in zip(batches, prepared, strict=True):
        if p is None:
            results.append(IngestResult())
            continue
        res, rows, end = p
        res.steps = sorted({r["step"] for r in rows.metrics})
        last_step = rows.last_step
        if end is not None:
            if rows.final_step >= 0:
                last_step = max(last_step if last_step is not None else -1, rows.final_step)
            _record_end(attempt, end)
            res.end = end
        for probe in (rows.probe, (end or {}).get("lr_probe")):
            if isinstance(probe, Mapping):
                _record_probe(attempt, probe)
        _update_aggregates(run, attempt, rows, last_step, res.max_seq)
        results.append(res)
    if live:
        session.flush()
    return results


_TABLES: tuple[tuple[str, Any], ...] = (
    ("metrics", MetricPoint.__table__),
    ("anomalies", AnomalyRow.__table__),
    ("checkpoints", CheckpointRow.__table__),
    ("evals", EvalPoint.__table__),
    ("layers", LayerSnapshotRow.__table__),
)
"""Where the rows go, in the order they are written."""


def _prepare(run: Run, attempt: Attempt, events: Iterable[Mapping[str, Any]],
             metrics_every_steps: int) -> tuple[IngestResult, _Rows, dict[str, Any] | None] | None:
    """One attempt's batch as rows (None: no events)."""
    evs = sorted(events, key=lambda e: _int(e.get("seq")))
    if not evs:
        return None
    res = IngestResult(max_seq=max(_int(e.get("seq")) for e in evs))
    end = next((dict(e["data"]) for e in reversed(evs) if e.get("type") == "end"), None)
    rows = _Rows(
        run_id=run.id, attempt_id=attempt.id, metrics_every_steps=metrics_every_steps,
        anomaly_steps={_int(e["data"].get("step"), -1) for e in evs if e.get("type") == "anomaly"},
        final_step=_int(end.get("final_step"), -1) if end is not None else -1,
    )
    for ev in evs:
        rows.add(ev)
    return res, rows, end


def _record_end(attempt: Attempt, end: Mapping[str, Any]) -> None:
    """The ``end`` event, stored whole (a newer worker's extra keys included); the onset also in its column."""
    attempt.outcome = jsonable(end)
    onset = end.get("onset_step")
    attempt.onset_step = _int(onset) if onset is not None else None


def _record_probe(attempt: Attempt, data: Mapping[str, Any]) -> None:
    """The LR probe's result on the attempt (once: a redelivered event changes nothing)."""
    applied = apply_probe_result(attempt.overrides or {}, attempt.plan or {}, attempt.reason, jsonable(data))
    if applied is not None:
        attempt.overrides, attempt.plan, attempt.reason = applied


def _update_aggregates(run: Run, attempt: Attempt, rows: _Rows, last_step: int | None, max_seq: int) -> None:
    """Maxima and minima only, so a redelivered batch changes nothing."""
    if last_step is not None and last_step >= 0:
        attempt.last_step = last_step if attempt.last_step is None else max(attempt.last_step, last_step)
        if attempt.number >= run.current_attempt:
            # the run is where its newest attempt is (a rollback moves it back)
            run.last_step = attempt.last_step
    if rows.best is not None:
        run.best_loss = rows.best if run.best_loss is None else min(run.best_loss, rows.best)
    attempt.last_seq = max(attempt.last_seq or 0, max_seq)
