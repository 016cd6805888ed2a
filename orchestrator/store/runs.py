"""Runs: submitting (recipe row, run, audit-log entry), reading one (``get_run``, the one-statement overview) and
listing them. Keyword arguments, ``add``/``flush`` only; the caller owns the transaction."""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy import select
from sqlalchemy.orm import Session, joinedload

from contracts.recipe import Recipe, recipe_to_dict
from orchestrator.policy.states import RunState
from orchestrator.store.db import AsyncReadPool, DriverRead
from orchestrator.store.models import AnomalyRow, Attempt, RecipeRow, Run, utcnow
from orchestrator.store.paging import PageResult, decode_cursor, encode_cursor
from orchestrator.store.transitions import log_creation


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
    log_creation(session=session, run=run, owner=owner, now=now)
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
    "failure_kind", "created_at", "updated_at", "started_at", "ended_at", "best_loss", "last_step", "retries_used",
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


_OVERVIEW_READS = {by_owner: DriverRead(_overview_statement(by_owner)) for by_owner in (False, True)}
_OVERVIEW_COUNT_AT = tuple(_OVERVIEW_READS[False].keys.index(k) for k in ("anomaly_kind", "anomaly_count"))


def get_run_overview(*, session: Session, run_id: int, owner: str | None = None) -> RunOverview | None:
    """The run with its recipe's hash and normalised JSON, its newest attempt and its anomaly counts, in one
    statement (one round trip on a connection of the session's engine, no ORM: ``DriverRead``), or None if absent
    or someone else's (``owner``). It sees committed data only, not the session's own pending changes.

    The counts are joined in as one row per anomaly kind, so a run with k kinds comes back as k rows (1 with
    none); the recipe's text is not read. This is the API's hottest read: separate run, newest-attempt and
    ``anomaly_counts`` queries cost three round trips and the ORM's loading on top.
    """
    engine = session.get_bind()
    assert isinstance(engine, sa.Engine), "sessions are bound to engines (make_session_factory)"
    return _overview(_OVERVIEW_READS[owner is not None].rows(engine, _overview_params(run_id, owner)))


async def read_run_overview(*, pool: AsyncReadPool, run_id: int, owner: str | None = None) -> RunOverview | None:
    """``get_run_overview`` on the event loop, on a connection of ``pool`` (PostgreSQL)."""
    return _overview(await _OVERVIEW_READS[owner is not None].arows(pool, _overview_params(run_id, owner)))


def _overview_params(run_id: int, owner: str | None) -> dict[str, Any]:
    return {"run_id": run_id} if owner is None else {"run_id": run_id, "owner": owner}


def _overview(rows: list[tuple[Any, ...]]) -> RunOverview | None:
    if not rows:
        return None
    keys = _OVERVIEW_READS[False].keys
    first = dict(zip(keys, rows[0], strict=True))  # the other rows differ only in the anomaly count columns
    kind, count = _OVERVIEW_COUNT_AT
    attempt = None
    if first["attempt_id"] is not None:
        attempt = {k: first[f"attempt_{k}"] for k in OVERVIEW_ATTEMPT_COLUMNS}
    return RunOverview(
        run={k: first[k] for k in OVERVIEW_RUN_COLUMNS},
        content_hash=first["recipe_content_hash"],
        recipe=first["recipe_parsed"],
        attempt=attempt,
        anomalies_by_kind={r[kind]: int(r[count]) for r in rows if r[kind] is not None},
    )


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
        created, last_id = decode_cursor(cursor, (datetime, int))
        stmt = stmt.where(sa.or_(Run.created_at < created, sa.and_(Run.created_at == created, Run.id < last_id)))
    rows = list(session.scalars(stmt.order_by(Run.created_at.desc(), Run.id.desc()).limit(limit + 1)))
    nxt = None
    if len(rows) > limit:
        rows = rows[:limit]
        nxt = encode_cursor(rows[-1].created_at.isoformat(), rows[-1].id)
    return PageResult(rows, count, nxt)
