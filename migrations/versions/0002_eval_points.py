"""Eval points: the held-out loss a worker measures every ``training.eval_interval`` steps.

A table of its own, not an ``eval_loss`` column on ``metric_points``: eval points are sparse (one per K steps),
are never downsampled at ingestion, and arrive in their own event, so a column would be NULL on almost every row
and an eval would have to UPDATE a metric row that downsampling may not have kept. Unique on (attempt_id, step)
so a redelivered event is ignored (``INSERT ... ON CONFLICT DO NOTHING``); indexed on (run_id, step) for the
metrics endpoint's query, like ``metric_points``. A new table only: no lock on the existing ones.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01 13:00:00.000000
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op


revision: str = '0002'
down_revision: str | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('eval_points',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('run_id', sa.Integer(), nullable=False),
    sa.Column('attempt_id', sa.Integer(), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('eval_loss', sa.Float(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['attempt_id'], ['attempts.id'], name=op.f('fk_eval_points_attempt_id_attempts'), ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_eval_points_run_id_runs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_eval_points')),
    sa.UniqueConstraint('attempt_id', 'step', name=op.f('uq_eval_points_attempt_id_step'))
    )
    with op.batch_alter_table('eval_points', schema=None) as batch_op:
        batch_op.create_index('ix_eval_points_run_id_step', ['run_id', 'step'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('eval_points', schema=None) as batch_op:
        batch_op.drop_index('ix_eval_points_run_id_step')

    op.drop_table('eval_points')
