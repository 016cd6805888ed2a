"""layer_snapshots: every per-layer gradient-norm snapshot, not only the newest per attempt.

Until now ingestion kept the newest ``layer_stats`` event of an attempt in ``attempts.ray_info["layer_stats"]``,
which answers "what does the profile look like now" but not "when did the deep layers start to vanish": the
dashboard's heat map (step × depth) needs the history. A table of its own, unique on (attempt_id, step) so a
redelivered event is ignored (``INSERT ... ON CONFLICT DO NOTHING``), indexed on (run_id, step) like the metric
tables. A new table only: no lock on the existing ones.

Data: the snapshot each attempt kept in ``ray_info`` becomes its first row (so old runs still show one column),
and the key is removed from ``ray_info`` (one place for the data). The downgrade puts each attempt's newest
snapshot back into ``ray_info`` before it drops the table, so the previous code reads what it expects.

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 10:00:00.000000
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

KEY = "layer_stats"
_attempts = sa.table("attempts", sa.column("id", sa.Integer()), sa.column("run_id", sa.Integer()),
                     sa.column("ray_info", sa.JSON()))
_snapshots = sa.table(
    "layer_snapshots", sa.column("id", sa.Integer()), sa.column("run_id", sa.Integer()),
    sa.column("attempt_id", sa.Integer()), sa.column("step", sa.Integer()),
    sa.column("block_grad_norms", sa.JSON()), sa.column("layer_grad_norms", sa.JSON()),
    sa.column("update_ratio", sa.Float()), sa.column("diagnosis", sa.String(200)),
    sa.column("created_at", sa.DateTime(timezone=True)),
)


def _finite(x: Any) -> float | None:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return None
    return float(x) if math.isfinite(float(x)) else None


def upgrade() -> None:
    op.create_table('layer_snapshots',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('attempt_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('block_grad_norms', sa.JSON(), nullable=False),
    sa.Column('layer_grad_norms', sa.JSON(), nullable=False),
    sa.Column('update_ratio', sa.Float(), nullable=True),
    sa.Column('diagnosis', sa.String(length=200), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['attempt_id'], ['attempts.id'], name=op.f('fk_layer_snapshots_attempt_id_attempts'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_layer_snapshots_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_layer_snapshots')),
    sa.UniqueConstraint('attempt_id', 'step', name=op.f('uq_layer_snapshots_attempt_id_step'))
    )
    with op.batch_alter_table('layer_snapshots', schema=None) as batch_op:
        batch_op.create_index('ix_layer_snapshots_run_id_step', ['run_id', 'step'], unique=False)

    conn = op.get_bind()
    now = datetime.now(UTC)
    rows = conn.execute(sa.select(_attempts.c.id, _attempts.c.run_id, _attempts.c.ray_info)).all()
    for att_id, run_id, info in rows:
        raw = (info or {}).get(KEY)
        if not isinstance(raw, dict):
            continue
        step = raw.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            blocks, layers, diagnosis = raw.get("block_grad_norms"), raw.get("layer_grad_norms"), raw.get("diagnosis")
            conn.execute(sa.insert(_snapshots).values(
                run_id=run_id, attempt_id=att_id, step=step,
                block_grad_norms=blocks if isinstance(blocks, list) else [],
                layer_grad_norms=layers if isinstance(layers, dict) else {},
                update_ratio=_finite(raw.get("update_ratio")),
                diagnosis=diagnosis[:200] if isinstance(diagnosis, str) else None, created_at=now,
            ))
        rest = {k: v for k, v in info.items() if k != KEY}
        conn.execute(sa.update(_attempts).where(_attempts.c.id == att_id).values(ray_info=rest))


def downgrade() -> None:
    conn = op.get_bind()
    newest = (
        sa.select(_snapshots.c.attempt_id, sa.func.max(_snapshots.c.step).label("step"))
        .group_by(_snapshots.c.attempt_id).subquery()
    )
    rows = conn.execute(
        sa.select(_snapshots, _attempts.c.ray_info)
        .join(newest, sa.and_(newest.c.attempt_id == _snapshots.c.attempt_id, newest.c.step == _snapshots.c.step))
        .join(_attempts, _attempts.c.id == _snapshots.c.attempt_id)
    ).mappings().all()
    for r in rows:
        snapshot = {"step": r["step"], "block_grad_norms": r["block_grad_norms"],
                    "layer_grad_norms": r["layer_grad_norms"], "update_ratio": r["update_ratio"],
                    "diagnosis": r["diagnosis"]}
        conn.execute(sa.update(_attempts).where(_attempts.c.id == r["attempt_id"])
                     .values(ray_info={**(r["ray_info"] or {}), KEY: snapshot}))

    with op.batch_alter_table('layer_snapshots', schema=None) as batch_op:
        batch_op.drop_index('ix_layer_snapshots_run_id_step')

    op.drop_table('layer_snapshots')
