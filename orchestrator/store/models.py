"""SQLAlchemy 2.0 ORM models. Pydantic request/response schemas live elsewhere (``api/schemas.py``)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship
from sqlalchemy.types import TypeDecorator

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """Timezone-aware UTC timestamps on every backend (SQLite stores them naive)."""

    impl = sa.DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            value = value.replace(tzinfo=UTC)
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: sa.Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


JSONType = sa.JSON()
BigIntPK = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


class Base(DeclarativeBase):
    metadata = sa.MetaData(naming_convention=NAMING_CONVENTION)


class ApiToken(Base):
    """A bearer token; only its peppered SHA-256 is stored."""

    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(100))
    principal: Mapped[str] = mapped_column(sa.String(100), index=True)
    token_hash: Mapped[str] = mapped_column(sa.String(64), unique=True)
    scopes: Mapped[list[str]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class RecipeRow(Base):
    """A submitted recipe: the text as sent, the normalised JSON, and a content hash of the normalised form."""

    __tablename__ = "recipes"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(sa.String(100))
    owner: Mapped[str] = mapped_column(sa.String(100))
    content_hash: Mapped[str] = mapped_column(sa.String(64), index=True)
    text: Mapped[str] = mapped_column(sa.Text)
    parsed: Mapped[dict[str, Any]] = mapped_column(JSONType)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Run(Base):
    __tablename__ = "runs"
    __table_args__ = (
        sa.Index("ix_runs_state_created_at", "state", "created_at"),
        sa.Index("ix_runs_owner_created_at", "owner", "created_at"),
        sa.UniqueConstraint("owner", "idempotency_key"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    recipe_id: Mapped[int] = mapped_column(sa.ForeignKey("recipes.id", ondelete="RESTRICT"))
    name: Mapped[str] = mapped_column(sa.String(100))
    owner: Mapped[str] = mapped_column(sa.String(100))
    state: Mapped[str] = mapped_column(sa.String(16))
    idempotency_key: Mapped[str | None] = mapped_column(sa.String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow, onupdate=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    current_attempt: Mapped[int] = mapped_column(default=0)
    retries_used: Mapped[int] = mapped_column(default=0)
    crash_restarts_used: Mapped[int] = mapped_column(default=0)
    best_loss: Mapped[float | None] = mapped_column(sa.Float)
    last_step: Mapped[int | None] = mapped_column()
    reason: Mapped[str | None] = mapped_column(sa.Text)
    failure_kind: Mapped[str | None] = mapped_column(sa.String(32))
    """A failed run's kind of failure (``orchestrator.policy.states.FailureKind``); None unless failed."""
    cancel_requested: Mapped[bool] = mapped_column(default=False)
    # scheduler lease: which scheduler owns the active run, until when (renewed while it runs)
    claimed_by: Mapped[str | None] = mapped_column(sa.String(200))
    lease_expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    recipe: Mapped[RecipeRow] = relationship(lazy="joined")
    attempts: Mapped[list[Attempt]] = relationship(
        back_populates="run", order_by="Attempt.number", cascade="all, delete-orphan"
    )


class Attempt(Base):
    """One try at a run: a worker group (or an in-place segment) with its effective settings."""

    __tablename__ = "attempts"
    __table_args__ = (sa.UniqueConstraint("run_id", "number"),)

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    number: Mapped[int] = mapped_column()
    state: Mapped[str] = mapped_column(sa.String(16))
    kind: Mapped[str] = mapped_column(sa.String(16), default="initial")
    """initial | numeric_retry | crash_restart | manual"""
    parent_checkpoint_id: Mapped[int | None] = mapped_column(
        sa.ForeignKey("checkpoints.id", ondelete="SET NULL", use_alter=True)
    )
    resume_step: Mapped[int] = mapped_column(default=0)
    overrides: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    """The effective settings as a diff against the recipe: {"optimizer.lr": [old, new], ...}."""
    plan: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    """Extra instructions for the workers: rewarm_steps, data_offset, resume_uri, in_place, lr_probe."""
    reason: Mapped[str | None] = mapped_column(sa.Text)
    outcome: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    """How it ended: onset_step, detector, value, final_step, error."""
    onset_step: Mapped[int | None] = mapped_column()
    last_step: Mapped[int | None] = mapped_column()
    last_seq: Mapped[int] = mapped_column(default=0)
    ray_info: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    ended_at: Mapped[datetime | None] = mapped_column(UTCDateTime)

    run: Mapped[Run] = relationship(back_populates="attempts")


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        sa.UniqueConstraint("attempt_id", "step"),
        sa.Index("ix_checkpoints_run_id_step", "run_id", "step"),
    )

    id: Mapped[int] = mapped_column(primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int] = mapped_column(sa.ForeignKey("attempts.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column()
    uri: Mapped[str] = mapped_column(sa.Text)
    sha256: Mapped[str] = mapped_column(sa.String(64))
    healthy: Mapped[bool] = mapped_column()
    verdict: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    """Why healthy or not: weights_finite, anomalies_since_previous, loss_in_bounds."""
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    deleted: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class AnomalyRow(Base):
    __tablename__ = "anomalies"
    __table_args__ = (
        sa.UniqueConstraint("attempt_id", "seq"),
        sa.Index("ix_anomalies_run_id_kind_step", "run_id", "kind", "step"),
        sa.Index("ix_anomalies_run_id_step", "run_id", "step"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int] = mapped_column(sa.ForeignKey("attempts.id", ondelete="CASCADE"))
    seq: Mapped[int] = mapped_column()
    step: Mapped[int] = mapped_column()
    rank: Mapped[int] = mapped_column(default=0)
    kind: Mapped[str] = mapped_column(sa.String(40))
    detector: Mapped[str] = mapped_column(sa.String(40))
    value: Mapped[float | None] = mapped_column(sa.Float)
    threshold: Mapped[float | None] = mapped_column(sa.Float)
    action: Mapped[str] = mapped_column(sa.String(16))
    details: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class MetricPoint(Base):
    __tablename__ = "metric_points"
    __table_args__ = (
        sa.UniqueConstraint("attempt_id", "step"),
        sa.Index("ix_metric_points_run_id_step", "run_id", "step"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int] = mapped_column(sa.ForeignKey("attempts.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column()
    loss: Mapped[float | None] = mapped_column(sa.Float)
    grad_norm: Mapped[float | None] = mapped_column(sa.Float)
    grad_norm_clipped: Mapped[float | None] = mapped_column(sa.Float)
    lr: Mapped[float | None] = mapped_column(sa.Float)
    loss_scale: Mapped[float | None] = mapped_column(sa.Float)
    throughput: Mapped[float | None] = mapped_column(sa.Float)
    skipped: Mapped[bool] = mapped_column(default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class EvalPoint(Base):
    """A held-out (eval) loss: sparse (every ``training.eval_interval`` steps), so a table of its own rather than a
    mostly-NULL column of ``metric_points``, and never downsampled at ingestion. ``step`` counts completed steps
    (the weights after that many updates), like a checkpoint's."""

    __tablename__ = "eval_points"
    __table_args__ = (
        sa.UniqueConstraint("attempt_id", "step"),
        sa.Index("ix_eval_points_run_id_step", "run_id", "step"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int] = mapped_column(sa.ForeignKey("attempts.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column()
    eval_loss: Mapped[float | None] = mapped_column(sa.Float)
    """NULL when it was not finite."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class LayerSnapshotRow(Base):
    """One ``layer_stats`` event: the per-block gradient norms by depth at one step, kept for every snapshot (not
    only the newest) so the dashboard can draw the profile over time. Every ``telemetry.layer_stats_every`` steps,
    so about a tenth of the metric rows; the per-parameter norms ride along as JSON (their names vary by model)."""

    __tablename__ = "layer_snapshots"
    __table_args__ = (
        sa.UniqueConstraint("attempt_id", "step"),
        sa.Index("ix_layer_snapshots_run_id_step", "run_id", "step"),
    )

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int] = mapped_column(sa.ForeignKey("attempts.id", ondelete="CASCADE"))
    step: Mapped[int] = mapped_column()
    block_grad_norms: Mapped[list[Any]] = mapped_column(JSONType)
    """Gradient norm of each block, input → output; non-finite values as the strings NaN/Infinity/-Infinity."""
    layer_grad_norms: Mapped[dict[str, Any]] = mapped_column(JSONType)
    """Gradient norm of each named parameter (same encoding)."""
    update_ratio: Mapped[float | None] = mapped_column(sa.Float)
    diagnosis: Mapped[str | None] = mapped_column(sa.String(200))
    """What the depth profile suggests (``vanishing with depth``), or NULL."""
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Event(Base):
    """The audit log: every state change of a run or attempt, with its reason."""

    __tablename__ = "events"
    __table_args__ = (sa.Index("ix_events_run_id_id", "run_id", "id"),)

    id: Mapped[int] = mapped_column(BigIntPK, primary_key=True)
    run_id: Mapped[int] = mapped_column(sa.ForeignKey("runs.id", ondelete="CASCADE"))
    attempt_id: Mapped[int | None] = mapped_column(sa.ForeignKey("attempts.id", ondelete="CASCADE"))
    entity: Mapped[str] = mapped_column(sa.String(16))
    from_state: Mapped[str | None] = mapped_column(sa.String(16))
    to_state: Mapped[str] = mapped_column(sa.String(16))
    reason: Mapped[str | None] = mapped_column(sa.Text)
    data: Mapped[dict[str, Any]] = mapped_column(JSONType, default=dict)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
