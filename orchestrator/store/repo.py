"""Data-access functions. They take keyword arguments, only ``add``/``flush``; the caller owns the transaction.

State changes of runs and attempts go through ``set_run_state`` / ``set_attempt_state`` only: each checks the
transition table in ``orchestrator.policy.states`` and writes an ``Event``.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar, cast

import sqlalchemy as sa
from sqlalchemy import select
from sqlalchemy.orm import Session, joinedload

from contracts.overrides import apply_overrides
from contracts.recipe import Recipe, recipe_to_dict
from orchestrator.policy.states import (
    TERMINAL_ATTEMPT_STATES,
    TERMINAL_RUN_STATES,
    AttemptState,
    IllegalTransition,
    RunState,
    check_attempt_transition,
    check_run_transition,
)
from orchestrator.store.models import (
    AnomalyRow,
    ApiToken,
    Attempt,
    CheckpointRow,
    Event,
    MetricPoint,
    RecipeRow,
    Run,
    utcnow,
)

T = TypeVar("T")


def set_run_state(
    *, session: Session, run: Run, to: RunState, reason: str | None = None, data: dict[str, Any] | None = None
) -> Event:
    """Move a run to ``to`` (raises IllegalTransition) and log it."""
    check_run_transition(run.state, to)
    ev = Event(
        run_id=run.id, entity="run", from_state=run.state, to_state=to.value, reason=reason, data=data or {}
    )
    now = utcnow()
    if to is RunState.starting and run.started_at is None:
        run.started_at = now
    if to in TERMINAL_RUN_STATES:
        run.ended_at = now
    elif run.ended_at is not None:
        run.ended_at = None
    run.state = to.value
    if reason is not None:
        run.reason = reason
    run.updated_at = now
    session.add(ev)
    session.flush()
    return ev


def set_attempt_state(
    *,
    session: Session,
    attempt: Attempt,
    to: AttemptState,
    reason: str | None = None,
    data: dict[str, Any] | None = None,
) -> Event:
    """Move an attempt to ``to`` (raises IllegalTransition) and log it."""
    check_attempt_transition(attempt.state, to)
    ev = Event(
        run_id=attempt.run_id,
        attempt_id=attempt.id,
        entity="attempt",
        from_state=attempt.state,
        to_state=to.value,
        reason=reason,
        data=data or {},
    )
    now = utcnow()
    if to is AttemptState.running and attempt.started_at is None:
        attempt.started_at = now
    if to in TERMINAL_ATTEMPT_STATES:
        attempt.ended_at = now
    attempt.state = to.value
    session.add(ev)
    session.flush()
    return ev


# ------------------------------------------------------------------------------------------------------------
# Queries and creation used by the REST API (api/). Same rules: keyword arguments, add/flush only.
# ------------------------------------------------------------------------------------------------------------
MANUAL_RETRY_KIND = "manual"
RECOVERY_KINDS = ("numeric_retry", "crash_restart", "manual")


def content_hash(parsed: Mapping[str, Any]) -> str:
    """SHA-256 of the normalised recipe as canonical JSON: equal recipes hash equal however they were written."""
    canonical = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def create_recipe(*, session: Session, owner: str, recipe: Recipe, text: str) -> RecipeRow:
    """Store a submitted recipe: the text as sent and its normalised form (defaults filled)."""
    row = _recipe_row(owner=owner, recipe=recipe, text=text)
    session.add(row)
    session.flush()
    return row


def _recipe_row(*, owner: str, recipe: Recipe, text: str) -> RecipeRow:
    parsed = recipe_to_dict(recipe)
    return RecipeRow(name=recipe.name, owner=owner, content_hash=content_hash(parsed), text=text, parsed=parsed)


_INSERT_EVENT = sa.insert(cast(sa.Table, Event.__table__))
"""A Core insert of one audit-log row, for writers that do not need the ``Event`` object back."""


def get_run_by_idempotency_key(*, session: Session, owner: str, key: str) -> Run | None:
    return session.scalars(select(Run).where(Run.owner == owner, Run.idempotency_key == key)).one_or_none()


def create_run(
    *, session: Session, owner: str, recipe: Recipe, text: str, idempotency_key: str | None = None
) -> tuple[Run, bool]:
    """A queued run for ``recipe``; returns ``(run, created)``.

    With an ``idempotency_key`` an earlier run of the same owner and key is returned instead (``created`` False),
    so a client retry never makes two runs. Two concurrent first submissions race on the unique
    ``(owner, idempotency_key)`` constraint: the loser's flush raises IntegrityError and the caller re-reads.
    """
    if idempotency_key is not None:
        existing = get_run_by_idempotency_key(session=session, owner=owner, key=idempotency_key)
        if existing is not None:
            return existing, False
    now = utcnow()
    run = Run(
        recipe=_recipe_row(owner=owner, recipe=recipe, text=text),
        name=recipe.name,
        owner=owner,
        state=RunState.queued.value,
        idempotency_key=idempotency_key,
        created_at=now,
        updated_at=now,
    )
    session.add(run)
    session.flush()  # one flush inserts the recipe, then the run (the relationship fills in recipe_id)
    # creation is not a transition (there is no "from" state), but it belongs in the audit log all the same; a
    # Core insert, since nothing here needs the Event object (an ORM flush of it costs several times more CPU)
    session.execute(_INSERT_EVENT, {"run_id": run.id, "attempt_id": None, "entity": "run", "from_state": None,
                                    "to_state": run.state, "reason": "submitted", "data": {"owner": owner},
                                    "created_at": now})
    return run, True


def get_run(*, session: Session, run_id: int, owner: str | None = None) -> Run | None:
    """The run, or None if it does not exist or belongs to someone else (``owner=None``: any owner)."""
    # the recipe's text (the document as sent) is rarely needed and can be large: loaded on access only
    stmt = select(Run).options(joinedload(Run.recipe).defer(RecipeRow.text)).where(Run.id == run_id)
    if owner is not None:
        stmt = stmt.where(Run.owner == owner)
    return session.scalars(stmt).one_or_none()


@dataclass(frozen=True)
class RunOverview:
    """A run as ``GET /runs/{id}`` shows it: plain values, no ORM objects (nothing to lazy-load later)."""

    run: dict[str, Any]
    """The run's columns by name (``OVERVIEW_RUN_COLUMNS``)."""
    content_hash: str
    recipe: dict[str, Any]
    """The normalised recipe (``recipes.parsed``)."""
    attempt: dict[str, Any] | None
    """The newest attempt's columns by name (``OVERVIEW_ATTEMPT_COLUMNS``); None before the first attempt."""
    anomalies_by_kind: dict[str, int]
    """Anomaly counts by kind across attempts, in kind order."""


OVERVIEW_RUN_COLUMNS = (
    "id", "name", "owner", "state", "recipe_id", "idempotency_key", "current_attempt", "cancel_requested", "reason",
    "created_at", "updated_at", "started_at", "ended_at", "best_loss", "last_step", "retries_used",
    "crash_restarts_used",
)
"""Every column of ``runs`` but the scheduler's lease."""
OVERVIEW_ATTEMPT_COLUMNS = (
    "id", "run_id", "number", "state", "kind", "parent_checkpoint_id", "resume_step", "overrides", "plan", "reason",
    "outcome", "onset_step", "last_step", "created_at", "started_at", "ended_at",
)
"""Every column of ``attempts`` but the event cursor (``last_seq``) and ``ray_info``."""


@functools.cache
def _overview_statement(by_owner: bool) -> sa.Select[Any]:
    """Built once per variant: composing a select of ~35 labelled columns costs more CPU than running it, and a
    reused statement object also keeps its compiled-cache key. Parameters: ``run_id`` (and ``owner``)."""
    runs, recipes, attempts = Run.__table__, RecipeRow.__table__, Attempt.__table__
    anomalies = AnomalyRow.__table__
    run_id = sa.bindparam("run_id", type_=sa.Integer())
    newest = select(sa.func.max(attempts.c.number)).where(attempts.c.run_id == run_id).scalar_subquery()
    counts = (
        select(anomalies.c.kind, sa.func.count().label("n"))
        .where(anomalies.c.run_id == run_id)
        .group_by(anomalies.c.kind)
        .subquery("anomaly_counts")
    )
    stmt = (
        select(
            *(runs.c[k] for k in OVERVIEW_RUN_COLUMNS),
            recipes.c.content_hash.label("recipe_content_hash"),
            recipes.c.parsed.label("recipe_parsed"),
            *(attempts.c[k].label(f"attempt_{k}") for k in OVERVIEW_ATTEMPT_COLUMNS),
            counts.c.kind.label("anomaly_kind"),
            counts.c.n.label("anomaly_count"),
        )
        .select_from(runs)
        .join(recipes, recipes.c.id == runs.c.recipe_id)
        .outerjoin(attempts, sa.and_(attempts.c.run_id == runs.c.id, attempts.c.number == newest))
        .outerjoin(counts, sa.true())
        .where(runs.c.id == run_id)
        .order_by(counts.c.kind)
    )
    if by_owner:
        stmt = stmt.where(runs.c.owner == sa.bindparam("owner", type_=sa.String()))
    return stmt


def get_run_overview(*, session: Session, run_id: int, owner: str | None = None) -> RunOverview | None:
    """The run with its recipe's hash and normalised JSON, its newest attempt and its anomaly counts, in one
    statement (one round trip, no ORM loading), or None if absent or someone else's (``owner``).

    The counts are joined in as one row per anomaly kind, so a run with k kinds comes back as k rows (1 with
    none); the recipe's text is not read. This is the API's hottest read: separate run, newest-attempt and
    ``anomaly_counts`` queries cost three round trips and the ORM's loading on top.
    """
    params: dict[str, Any] = {"run_id": run_id}
    if owner is not None:
        params["owner"] = owner
    rows = session.execute(_overview_statement(owner is not None), params).all()
    if not rows:
        return None
    first = rows[0]._mapping
    attempt = None
    if first["attempt_id"] is not None:
        attempt = {k: first[f"attempt_{k}"] for k in OVERVIEW_ATTEMPT_COLUMNS}
    return RunOverview(
        run={k: first[k] for k in OVERVIEW_RUN_COLUMNS},
        content_hash=first["recipe_content_hash"],
        recipe=first["recipe_parsed"],
        attempt=attempt,
        anomalies_by_kind={r.anomaly_kind: int(r.anomaly_count) for r in rows if r.anomaly_kind is not None},
    )


@dataclass(frozen=True)
class PageResult(Generic[T]):
    """One page of a keyset-paginated listing: the rows, the total matching the filters, the next cursor."""

    rows: list[T]
    count: int
    next_cursor: str | None


class BadCursor(ValueError):
    """A cursor that this listing did not produce (the API maps it to 422 naming ``cursor``)."""


def _encode_cursor(*parts: Any) -> str:
    raw = json.dumps(list(parts), separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _decode_cursor(cursor: str, kinds: tuple[type, ...]) -> list[Any]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        parts = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadCursor("not a cursor from this listing") from None
    if not isinstance(parts, list) or len(parts) != len(kinds):
        raise BadCursor("not a cursor from this listing")
    out: list[Any] = []
    for part, kind in zip(parts, kinds, strict=True):
        if kind is datetime:
            if not isinstance(part, str):
                raise BadCursor("not a cursor from this listing")
            try:
                when = datetime.fromisoformat(part)
            except ValueError:
                raise BadCursor("not a cursor from this listing") from None
            out.append(when if when.tzinfo else when.replace(tzinfo=UTC))
        elif kind is int:
            if not isinstance(part, int) or isinstance(part, bool) or not 0 <= part < 2**63:
                raise BadCursor("not a cursor from this listing")
            out.append(part)
    return out


def list_runs(
    *,
    session: Session,
    owner: str | None = None,
    states: Sequence[RunState] = (),
    name: str | None = None,
    limit: int = 50,
    cursor: str | None = None,
) -> PageResult[Run]:
    """Runs newest first, ordered by ``(created_at, id)`` so runs created in the same instant page stably."""
    filters: list[sa.ColumnElement[bool]] = []
    if owner is not None:
        filters.append(Run.owner == owner)
    if states:
        filters.append(Run.state.in_([s.value for s in states]))
    if name is not None:
        filters.append(Run.name == name)
    count = session.scalar(select(sa.func.count()).select_from(Run).where(*filters)) or 0
    stmt = select(Run).options(joinedload(Run.recipe).defer(RecipeRow.text)).where(*filters)
    if cursor is not None:
        created, last_id = _decode_cursor(cursor, (datetime, int))
        stmt = stmt.where(sa.or_(Run.created_at < created, sa.and_(Run.created_at == created, Run.id < last_id)))
    rows = list(session.scalars(stmt.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit + 1)))
    nxt = None
    if len(rows) > limit:
        rows = rows[:limit]
        nxt = _encode_cursor(rows[-1].created_at.isoformat(), rows[-1].id)
    return PageResult(rows, count, nxt)


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
        (last_id,) = _decode_cursor(cursor, (int,))
        stmt = stmt.where(AnomalyRow.id > last_id)
    rows = [(a, int(n)) for a, n in session.execute(stmt.order_by(AnomalyRow.id).limit(limit + 1))]
    nxt = None
    if len(rows) > limit:
        rows = rows[:limit]
        nxt = _encode_cursor(rows[-1][0].id)
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


METRIC_SERIES = ("loss", "grad_norm", "grad_norm_clipped", "lr", "loss_scale", "throughput")


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
    carries its attempt number; missing (NULL) values are left out of that series.
    """
    unknown = [s for s in series if s not in METRIC_SERIES]
    if unknown:
        raise ValueError(f"unknown metric series {unknown}; known: {list(METRIC_SERIES)}")
    cols = [getattr(MetricPoint, s) for s in series]
    filters: list[sa.ColumnElement[bool]] = [MetricPoint.run_id == run_id]
    if step_min is not None:
        filters.append(MetricPoint.step >= step_min)
    if step_max is not None:
        filters.append(MetricPoint.step <= step_max)
    if attempt is not None:
        filters.append(Attempt.number == attempt)
    stmt = (
        select(MetricPoint.step, Attempt.number, *cols)
        .join(Attempt, Attempt.id == MetricPoint.attempt_id)
        .where(*filters)
        .order_by(Attempt.number, MetricPoint.step)
    )
    rows = session.execute(stmt).all()
    out: list[Series] = []
    for j, name in enumerate(series):
        pts = [(int(r[0]), int(r[1]), float(r[2 + j])) for r in rows if r[2 + j] is not None]
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


def request_cancel(*, session: Session, run: Run, by: str) -> Run:
    """Cancel a run: a queued one at once; an active one by flagging it for the scheduler to stop.

    A finished run cannot be cancelled (IllegalTransition, a 409 at the API).
    """
    state = RunState(run.state)
    if state is RunState.queued:
        for att in run.attempts:
            if att.state == AttemptState.pending.value:
                set_attempt_state(session=session, attempt=att, to=AttemptState.cancelled, reason=f"cancelled by {by}")
        set_run_state(session=session, run=run, to=RunState.cancelled, reason=f"cancelled by {by}")
    elif state in TERMINAL_RUN_STATES:
        raise IllegalTransition("run", state.value, RunState.cancelled.value)
    elif not run.cancel_requested:
        run.cancel_requested = True
        run.updated_at = utcnow()
        session.flush()
    return run


def request_retry(
    *,
    session: Session,
    run: Run,
    by: str,
    overrides: Mapping[str, Any] | None = None,
) -> Attempt:
    """Re-queue a failed or cancelled run with a new ``pending`` attempt of kind ``manual``.

    The new attempt inherits the previous attempt's overrides (the settings it had tightened to) with the
    caller's ``{"path": new_value}`` on top, stored as ``{"path": [recipe_value, new_value]}`` and validated
    against the recipe schema (RecipeError naming the path). It resumes from the newest healthy checkpoint, if
    there is one. Other states raise IllegalTransition (409).
    """
    check_run_transition(run.state, RunState.queued)
    recipe = Recipe.model_validate(run.recipe.parsed, context={"allowed_import_modules": _factory_modules(run)})
    base_doc = recipe_to_dict(recipe)
    previous = max(run.attempts, key=lambda a: a.number, default=None)
    merged: dict[str, Any] = {}
    if previous is not None:
        merged.update({k: _override_new(v) for k, v in previous.overrides.items()})
    for path, value in (overrides or {}).items():
        merged[path] = _override_new(value)
    effective = apply_overrides(recipe, merged)
    diff = {path: [_get_path(base_doc, path), _get_path(recipe_to_dict(effective), path)] for path in merged}
    ckpt = session.scalars(
        select(CheckpointRow)
        .where(CheckpointRow.run_id == run.id, CheckpointRow.healthy.is_(True), CheckpointRow.deleted.is_(False))
        .order_by(CheckpointRow.step.desc(), CheckpointRow.id.desc())
        .limit(1)
    ).one_or_none()
    plan: dict[str, Any] = {"rewarm_steps": 0, "data_offset": 0, "resume_uri": None}
    if ckpt is not None:
        plan = {"rewarm_steps": effective.recovery.rewarm_steps, "data_offset": 0, "resume_uri": ckpt.uri}
    number = (previous.number if previous is not None else 0) + 1
    reason = f"manual retry by {by}"
    attempt = Attempt(
        run_id=run.id,
        number=number,
        state=AttemptState.pending.value,
        kind=MANUAL_RETRY_KIND,
        parent_checkpoint_id=ckpt.id if ckpt is not None else None,
        resume_step=ckpt.step if ckpt is not None else 0,
        overrides=diff,
        plan=plan,
        reason=reason,
    )
    session.add(attempt)
    session.flush()
    run.cancel_requested = False
    run.current_attempt = number
    set_run_state(session=session, run=run, to=RunState.queued, reason=reason,
                  data={"attempt": number, "overrides": diff})
    return attempt


def _factory_modules(run: Run) -> list[str]:
    """Modules of import strings the stored recipe already names (admitted when it was accepted)."""
    mods: list[str] = []
    for section in ("model", "data"):
        part = run.recipe.parsed.get(section)
        if isinstance(part, dict) and part.get("name") == "custom" and isinstance(part.get("factory"), str):
            mods.append(part["factory"].split(":", 1)[0])
    return mods


def _override_new(change: Any) -> Any:
    """``[old, new]`` (the stored form) → new; a bare value is already the new value."""
    if isinstance(change, list | tuple) and len(change) == 2:
        return change[1]
    return change


def _get_path(doc: Any, path: str) -> Any:
    node = doc
    for part in path.split("."):
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def create_token(
    *, session: Session, name: str, principal: str, scopes: Sequence[str], token_hash: str
) -> ApiToken:
    """Store a token by its hash (the plaintext is shown once to its creator and never stored)."""
    tok = ApiToken(name=name, principal=principal, scopes=sorted(set(scopes)), token_hash=token_hash)
    session.add(tok)
    session.flush()
    return tok


def get_token_by_hash(*, session: Session, token_hash: str) -> ApiToken | None:
    """A live (not revoked) token by its hash."""
    return session.scalars(
        select(ApiToken).where(ApiToken.token_hash == token_hash, ApiToken.revoked_at.is_(None))
    ).one_or_none()


def list_tokens(*, session: Session, principal: str | None = None) -> list[ApiToken]:
    stmt = select(ApiToken).order_by(ApiToken.id)
    if principal is not None:
        stmt = stmt.where(ApiToken.principal == principal)
    return list(session.scalars(stmt))


def revoke_token(*, session: Session, token_id: int) -> ApiToken | None:
    tok = session.get(ApiToken, token_id)
    if tok is not None and tok.revoked_at is None:
        tok.revoked_at = utcnow()
        session.flush()
    return tok
