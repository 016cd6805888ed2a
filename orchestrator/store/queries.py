"""A run's children as the API reads them: attempts, anomalies, checkpoints, metric series (min/max downsampled),
per-layer snapshots, anomaly counts, and what the live event stream polls (audit-log rows, anomalies and the newest
metric after a position). Keyword arguments, read-only."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy import select
from sqlalchemy.orm import Session

from orchestrator.store.models import (
    AnomalyRow,
    Attempt,
    CheckpointRow,
    EvalPoint,
    Event,
    LayerSnapshotRow,
    MetricPoint,
    Run,
)
from orchestrator.store.paging import PageResult, decode_cursor, encode_cursor


def anomaly_counts(*, session: Session, run_ids: Sequence[int]) -> dict[int, dict[str, int]]:
    """``{run_id: {kind: count}}`` for a page of runs, in one grouped query."""
    out: dict[int, dict[str, int]] = {rid: {} for rid in run_ids}
    if not run_ids:
        return out
    stmt = (
        select(AnomalyRow.run_id, AnomalyRow.kind, sa.func.count())
        .where(AnomalyRow.run_id.in_(list(run_ids)))
        .group_by(AnomalyRow.run_id, AnomalyRow.kind)
    )
    for run_id, kind, n in session.execute(stmt):
        out[run_id][kind] = int(n)
    return out


def current_overrides(*, session: Session, run_ids: Sequence[int]) -> dict[int, dict[str, object]]:
    """``{run_id: overrides}`` of each run's current attempt (``{}`` before its first), in one query: what the
    run is doing now differs from its recipe after a tightened or manual retry (e.g. ``training.max_steps``)."""
    out: dict[int, dict[str, object]] = {rid: {} for rid in run_ids}
    if not run_ids:
        return out
    stmt = (
        select(Attempt.run_id, Attempt.overrides)
        .join(Run, sa.and_(Run.id == Attempt.run_id, Run.current_attempt == Attempt.number))
        .where(Attempt.run_id.in_(list(run_ids)))
    )
    for run_id, overrides in session.execute(stmt):
        out[run_id] = dict(overrides or {})
    return out


def get_attempt(*, session: Session, run_id: int, number: int) -> Attempt | None:
    return session.scalars(
        select(Attempt).where(Attempt.run_id == run_id, Attempt.number == number)
    ).one_or_none()


def list_attempts(*, session: Session, run_id: int) -> list[Attempt]:
    """Every attempt of a run in order (a run has a handful, bounded by its retry budgets)."""
    return list(session.scalars(select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)))


def list_anomalies(
    *,
    session: Session,
    run_id: int,
    kind: str | None = None,
    attempt: int | None = None,
    step_min: int | None = None,
    step_max: int | None = None,
    limit: int = 100,
    cursor: str | None = None,
) -> PageResult[tuple[AnomalyRow, int]]:
    """A run's anomalies in arrival order (id), each with its attempt number; ``attempt`` is a number."""
    filters: list[sa.ColumnElement[bool]] = [AnomalyRow.run_id == run_id]
    if kind is not None:
        filters.append(AnomalyRow.kind == kind)
    if attempt is not None:
        filters.append(Attempt.number == attempt)
    if step_min is not None:
        filters.append(AnomalyRow.step >= step_min)
    if step_max is not None:
        filters.append(AnomalyRow.step <= step_max)
    base = select(AnomalyRow, Attempt.number).join(Attempt, Attempt.id == AnomalyRow.attempt_id).where(*filters)
    count = session.scalar(select(sa.func.count()).select_from(base.subquery())) or 0
    stmt = base
    if cursor is not None:
        (last_id,) = decode_cursor(cursor, (int,))
        stmt = stmt.where(AnomalyRow.id > last_id)
    rows = [(a, int(n)) for a, n in session.execute(stmt.order_by(AnomalyRow.id).limit(limit + 1))]
    nxt = None
    if len(rows) > limit:
        rows = rows[:limit]
        nxt = encode_cursor(rows[-1][0].id)
    return PageResult(rows, count, nxt)


def list_checkpoints(*, session: Session, run_id: int) -> list[tuple[CheckpointRow, int]]:
    """A run's checkpoints (including deleted ones, flagged) by step, each with its attempt number."""
    stmt = (
        select(CheckpointRow, Attempt.number)
        .join(Attempt, Attempt.id == CheckpointRow.attempt_id)
        .where(CheckpointRow.run_id == run_id)
        .order_by(CheckpointRow.step, CheckpointRow.id)
    )
    return [(c, int(n)) for c, n in session.execute(stmt)]


def list_layer_snapshots(
    *,
    session: Session,
    run_id: int,
    attempt: int | None = None,
    after_step: int | None = None,
    limit: int = 500,
    cursor: str | None = None,
) -> PageResult[tuple[LayerSnapshotRow, int]]:
    """A run's per-layer snapshots in (attempt number, step) order, each with its attempt number.

    ``after_step`` keeps steps above it (with ``attempt``, what a live page has not seen yet); the cursor is the
    last (attempt number, step) of the previous page, so a snapshot ingested late lands in its place in the order.
    """
    filters: list[sa.ColumnElement[bool]] = [LayerSnapshotRow.run_id == run_id]
    if attempt is not None:
        filters.append(Attempt.number == attempt)
    if after_step is not None:
        filters.append(LayerSnapshotRow.step > after_step)
    base = (select(LayerSnapshotRow, Attempt.number)
            .join(Attempt, Attempt.id == LayerSnapshotRow.attempt_id).where(*filters))
    count = session.scalar(select(sa.func.count()).select_from(base.subquery())) or 0
    stmt = base
    if cursor is not None:
        number, step = decode_cursor(cursor, (int, int))
        stmt = stmt.where(sa.tuple_(Attempt.number, LayerSnapshotRow.step) > sa.tuple_(number, step))
    ordered = stmt.order_by(Attempt.number, LayerSnapshotRow.step).limit(limit + 1)
    rows = [(snap, int(n)) for snap, n in session.execute(ordered)]
    nxt = None
    if len(rows) > limit:
        rows = rows[:limit]
        nxt = encode_cursor(rows[-1][1], rows[-1][0].step)
    return PageResult(rows, count, nxt)


METRIC_SERIES = ("loss", "grad_norm", "grad_norm_clipped", "lr", "loss_scale", "throughput", "eval_loss", "skipped")
EVAL_SERIES = frozenset({"eval_loss"})
"""Series read from ``eval_points`` (sparse: every ``training.eval_interval`` steps) rather than ``metric_points``."""
SKIPPED = "skipped"
"""The steps whose update was discarded (a guard's ``skip_step``, an fp16 overflow), each with the value 1: sparse.
Their loss is the batch's, not the model's, which is why the outcome verdict leaves them out of the final loss and a
reader who judges a curve needs to know them."""
_SKIPPED_VALUE = sa.case((MetricPoint.skipped.is_(True), sa.literal(1.0)), else_=sa.null())


@dataclass(frozen=True)
class Series:
    """One metric over steps, in (attempt, step) order; ``total`` points before downsampling."""

    name: str
    steps: list[int]
    values: list[float]
    attempts: list[int]
    total: int

    @property
    def downsampled(self) -> bool:
        return len(self.steps) < self.total


def downsample_min_max(values: Sequence[float], max_points: int) -> list[int]:
    """Indices to keep so at most ``max_points`` remain and every bucket keeps its min and its max.

    Plain striding would drop a one-step spike; keeping each bucket's extremes (in their original order) keeps
    it. A non-finite value (NaN, inf) counts as the bucket's extreme, since it is the event a reader looks for.
    """
    n = len(values)
    if n <= max_points:
        return list(range(n))
    buckets = max(1, max_points // 2)
    keep: list[int] = []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        if lo >= hi:
            continue
        idx = range(lo, hi)
        finite = [i for i in idx if math.isfinite(values[i])]
        bad = [i for i in idx if not math.isfinite(values[i])]
        if bad:
            pair = {bad[0], max(finite, key=lambda i: values[i]) if finite else bad[-1]}
        else:
            pair = {min(idx, key=lambda i: values[i]), max(idx, key=lambda i: values[i])}
        keep.extend(sorted(pair))
    return keep


def metric_series(
    *,
    session: Session,
    run_id: int,
    series: Sequence[str] = METRIC_SERIES,
    step_min: int | None = None,
    step_max: int | None = None,
    attempt: int | None = None,
    max_points: int = 1000,
) -> list[Series]:
    """Per-step metrics of a run in (attempt, step) order, each series downsampled to ``max_points``.

    Steps repeat across attempts after a rollback (attempt 2 re-runs steps after its checkpoint), so each point
    carries its attempt number; missing (NULL) values are left out of that series. ``eval_loss`` comes from
    ``eval_points`` (its steps count completed steps, like a checkpoint's), the others from ``metric_points``.
    """
    unknown = [s for s in series if s not in METRIC_SERIES]
    if unknown:
        raise ValueError(f"unknown metric series {unknown}; known: {list(METRIC_SERIES)}")
    points: dict[str, list[tuple[int, int, float]]] = {}
    for table, names in ((MetricPoint, [s for s in series if s not in EVAL_SERIES]),
                         (EvalPoint, [s for s in series if s in EVAL_SERIES])):
        if names:
            points |= _points(session, table, names, run_id=run_id, step_min=step_min, step_max=step_max,
                              attempt=attempt)
    out: list[Series] = []
    for name in series:
        pts = points[name]
        keep = downsample_min_max([p[2] for p in pts], max_points)
        out.append(
            Series(
                name=name,
                steps=[pts[i][0] for i in keep],
                values=[pts[i][2] for i in keep],
                attempts=[pts[i][1] for i in keep],
                total=len(pts),
            )
        )
    return out


def _points(session: Session, table: type[MetricPoint] | type[EvalPoint], names: Sequence[str], *, run_id: int,
            step_min: int | None, step_max: int | None,
            attempt: int | None) -> dict[str, list[tuple[int, int, float]]]:
    """(step, attempt number, value) of each named column of ``table`` in (attempt, step) order, NULLs left out
    (``skipped``: 1 where the step was skipped, else left out)."""
    cols = [_SKIPPED_VALUE if s == SKIPPED else getattr(table, s) for s in names]
    filters: list[sa.ColumnElement[bool]] = [table.run_id == run_id]
    if step_min is not None:
        filters.append(table.step >= step_min)
    if step_max is not None:
        filters.append(table.step <= step_max)
    if attempt is not None:
        filters.append(Attempt.number == attempt)
    stmt = (
        select(table.step, Attempt.number, *cols)
        .join(Attempt, Attempt.id == table.attempt_id)
        .where(*filters)
        .order_by(Attempt.number, table.step)
    )
    rows = session.execute(stmt).all()
    return {name: [(int(r[0]), int(r[1]), float(r[2 + j])) for r in rows if r[2 + j] is not None]
            for j, name in enumerate(names)}


# --------------------------------------------------------------------------- what the live event stream polls
def state_changes_after(*, session: Session, run_id: int, after: int, limit: int) -> list[Event]:
    """The run's audit-log rows with ``id > after``, oldest first, at most ``limit``."""
    stmt = select(Event).where(Event.run_id == run_id, Event.id > after).order_by(Event.id).limit(limit)
    return list(session.scalars(stmt))


def anomalies_after(*, session: Session, run_id: int, after: int, limit: int) -> list[tuple[AnomalyRow, int]]:
    """The run's anomalies with ``id > after`` in arrival order, each with its attempt number, at most ``limit``."""
    stmt = (
        select(AnomalyRow, Attempt.number)
        .join(Attempt, Attempt.id == AnomalyRow.attempt_id)
        .where(AnomalyRow.run_id == run_id, AnomalyRow.id > after)
        .order_by(AnomalyRow.id)
        .limit(limit)
    )
    return [(a, int(n)) for a, n in session.execute(stmt)]


def newest_metric_after(*, session: Session, run_id: int, after: int) -> tuple[MetricPoint, int] | None:
    """The run's newest metric point (with its attempt number) if it has ``id > after``: a watcher wants the
    current loss, not every step."""
    stmt = (
        select(MetricPoint, Attempt.number)
        .join(Attempt, Attempt.id == MetricPoint.attempt_id)
        .where(MetricPoint.run_id == run_id, MetricPoint.id > after)
        .order_by(MetricPoint.id.desc())
        .limit(1)
    )
    row = session.execute(stmt).first()
    return None if row is None else (row[0], int(row[1]))
