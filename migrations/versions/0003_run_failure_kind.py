"""runs.failure_kind: why a failed run failed, as a kind a client can branch on.

``runs.reason`` holds the words (the last transition's reason); ``failure_kind`` the category the rule that failed
the run names (``config_error``, ``gave_up``, ``start_failed``, ``lost``), so the API and the CLI can tell "the
recipe cannot run as written" from "the recovery policy gave up" without parsing text. Nullable and without a
default: adding it rewrites nothing on PostgreSQL (no table rewrite, a brief ACCESS EXCLUSIVE lock only); runs
that failed before it existed read NULL (unknown).

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 13:00:00.000000
"""
from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.add_column(sa.Column('failure_kind', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('runs', schema=None) as batch_op:
        batch_op.drop_column('failure_kind')
