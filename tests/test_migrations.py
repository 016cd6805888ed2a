"""Alembic migrations on both backends: one head, up/down/up with data present, and no drift from the ORM."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.orm import Session

import migrations
from orchestrator.store.db import make_engine
from orchestrator.store.models import (
    AnomalyRow,
    ApiToken,
    Attempt,
    Base,
    CheckpointRow,
    EvalPoint,
    Event,
    LayerSnapshotRow,
    MetricPoint,
    RecipeRow,
    Run,
)

BALLAST = Path(sys.executable).with_name("ballast")
APP_TABLES = {t.name for t in Base.metadata.sorted_tables}


def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(migrations.alembic_config("sqlite://"))


def _head() -> str:
    head = _script().get_current_head()
    assert head is not None
    return head


def _current(url: str) -> str | None:
    engine = make_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return MigrationContext.configure(conn).get_current_revision()
    finally:
        engine.dispose()


def _tables(url: str) -> set[str]:
    engine = make_engine(url, poolclass=sa.pool.NullPool)
    try:
        return set(sa.inspect(engine).get_table_names())
    finally:
        engine.dispose()


def _fill_every_table(url: str, tag: str) -> dict[str, int]:
    """Insert one linked row in every table (the attempt→checkpoint cycle included); return the counts."""
    engine = make_engine(url, poolclass=sa.pool.NullPool)
    try:
        with Session(engine) as s, s.begin():
            s.add(ApiToken(name="ci", principal="alice", token_hash=tag.ljust(64, "0"), scopes=["runs:read"]))
            recipe = RecipeRow(name="r", owner="alice", content_hash="a" * 64, text="name: r\n", parsed={"name": "r"})
            s.add(recipe)
            s.flush()
            run = Run(recipe_id=recipe.id, name="r", owner="alice", state="running", idempotency_key=tag)
            s.add(run)
            s.flush()
            first = Attempt(run_id=run.id, number=1, state="diverged", overrides={"optimizer.lr": [1e-3, 5e-4]})
            s.add(first)
            s.flush()
            ckpt = CheckpointRow(run_id=run.id, attempt_id=first.id, step=50, uri="file:///c/50", sha256="b" * 64,
                                 healthy=True, metrics={"loss": 2.5})
            s.add(ckpt)
            s.flush()
            second = Attempt(run_id=run.id, number=2, state="running", parent_checkpoint_id=ckpt.id, resume_step=50)
            s.add(second)
            s.flush()
            s.add(AnomalyRow(run_id=run.id, attempt_id=first.id, seq=1, step=60, kind="loss_spike",
                             detector="loss_spike", value=9.0, threshold=6.0, action="rollback"))
            s.add(MetricPoint(run_id=run.id, attempt_id=first.id, step=60, loss=2.4, grad_norm=1.5, lr=1e-3))
            s.add(EvalPoint(run_id=run.id, attempt_id=first.id, step=60, eval_loss=2.6))
            s.add(LayerSnapshotRow(run_id=run.id, attempt_id=first.id, step=60, block_grad_norms=[1.0, "Infinity"],
                                layer_grad_norms={"blocks.0.w": 1.0}, update_ratio=1e-3, diagnosis=None))
            s.add(Event(run_id=run.id, attempt_id=second.id, entity="attempt", from_state="pending",
                        to_state="running"))
        with engine.connect() as conn:
            return {t: conn.execute(sa.select(sa.func.count()).select_from(sa.table(t))).scalar_one()
                    for t in APP_TABLES}
    finally:
        engine.dispose()


def _diff(url: str) -> list[Any]:
    engine = make_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            ctx = MigrationContext.configure(
                conn,
                opts={
                    "compare_type": True,
                    "compare_server_default": True,
                    "render_as_batch": conn.dialect.name == "sqlite",
                },
            )
            return list(compare_metadata(ctx, Base.metadata))
    finally:
        engine.dispose()


# ------------------------------------------------------------------------------------------------- tests
def test_exactly_one_head_and_a_linear_history() -> None:
    script = _script()
    assert len(script.get_heads()) == 1
    assert len(script.get_bases()) == 1
    revisions = list(script.walk_revisions())
    assert all(not rev.is_merge_point and not rev.is_branch_point for rev in revisions)
    assert all(rev.doc and rev.doc.strip() for rev in revisions), "every migration says what it does"


def test_upgrade_downgrade_upgrade_with_data(empty_db_url: str) -> None:
    url = empty_db_url
    assert _current(url) is None
    assert _tables(url) == set()

    migrations.upgrade(url)
    assert _current(url) == _head()
    assert _tables(url) == APP_TABLES | {"alembic_version"}
    assert _fill_every_table(url, "first") == dict.fromkeys(APP_TABLES, 1) | {"attempts": 2}

    # step down one revision at a time, with the rows still there
    script = _script()
    for rev in script.walk_revisions():
        assert _current(url) == rev.revision
        migrations.downgrade(url, "-1")
        assert _current(url) == rev.down_revision
    assert _tables(url) - {"alembic_version"} == set()

    migrations.upgrade(url)
    assert _current(url) == _head()
    assert _fill_every_table(url, "second") == dict.fromkeys(APP_TABLES, 1) | {"attempts": 2}


def test_every_revision_upgrades_one_step_at_a_time(empty_db_url: str) -> None:
    revisions = list(reversed(list(_script().walk_revisions())))
    for rev in revisions:
        migrations.upgrade(empty_db_url, rev.revision)
        assert _current(empty_db_url) == rev.revision
    assert _diff(empty_db_url) == []


def test_migrations_match_the_orm_models(empty_db_url: str) -> None:
    """Drift test: autogenerate against the ORM metadata finds nothing to change."""
    migrations.upgrade(empty_db_url)
    assert _diff(empty_db_url) == []


def test_drift_test_notices_a_difference(empty_db_url: str) -> None:
    """The drift check is live: a column the migrations do not create shows up as a difference."""
    migrations.upgrade(empty_db_url)
    engine = make_engine(empty_db_url, poolclass=sa.pool.NullPool)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("ALTER TABLE runs ADD COLUMN stray INTEGER"))
    finally:
        engine.dispose()
    diff = _diff(empty_db_url)
    assert [(d[0], d[3].name) for d in diff] == [("remove_column", "stray")]


def test_0004_moves_the_kept_layer_snapshot_into_its_table_and_back(empty_db_url: str) -> None:
    """Before 0004 the newest snapshot of an attempt lived in ``ray_info``: the upgrade makes it the attempt's
    first ``layer_snapshots`` row (and drops the key), the downgrade puts the newest row back."""
    url = empty_db_url
    migrations.upgrade(url, "0003")
    stats = {"step": 40, "block_grad_norms": [2.0, "Infinity"], "layer_grad_norms": {"blocks.0.w": 2.0},
             "update_ratio": 0.004, "diagnosis": "vanishing with depth"}
    engine = make_engine(url, poolclass=sa.pool.NullPool)
    attempts = sa.table("attempts", sa.column("id"), sa.column("ray_info", sa.JSON()))
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO recipes (name, owner, content_hash, text, parsed, created_at) "
                                 "VALUES ('r', 'a', 'h', 't', '{}', CURRENT_TIMESTAMP)"))
            conn.execute(sa.text("INSERT INTO runs (recipe_id, name, owner, state, created_at, updated_at, "
                                 "current_attempt, retries_used, crash_restarts_used, cancel_requested) "
                                 "VALUES (1, 'r', 'a', 'running', CURRENT_TIMESTAMP, CURRENT_TIMESTAMP, 2, 0, 0, "
                                 "false)"))
            for number, info in ((1, {"channel": "c1", "layer_stats": stats}), (2, {"channel": "c2"})):
                conn.execute(sa.text(
                    "INSERT INTO attempts (run_id, number, state, kind, resume_step, overrides, plan, last_seq, "
                    "ray_info, created_at) VALUES (1, :n, 'running', 'initial', 0, '{}', '{}', 0, :info, "
                    "CURRENT_TIMESTAMP)").bindparams(sa.bindparam("info", type_=sa.JSON())), {"n": number,
                                                                                             "info": info})
        migrations.upgrade(url, "0004")
        with engine.connect() as conn:
            infos = dict(conn.execute(sa.select(attempts.c.id, attempts.c.ray_info)).all())
            rows = conn.execute(sa.text("SELECT attempt_id, step, diagnosis, update_ratio FROM layer_snapshots")).all()
        assert infos == {1: {"channel": "c1"}, 2: {"channel": "c2"}}
        assert [tuple(r) for r in rows] == [(1, 40, "vanishing with depth", 0.004)]
        with Session(engine) as s, s.begin():
            s.add(LayerSnapshotRow(run_id=1, attempt_id=1, step=50, block_grad_norms=[1.5, 0.1],
                                layer_grad_norms={}, update_ratio=None, diagnosis=None))
        migrations.downgrade(url, "0003")
        with engine.connect() as conn:
            infos = dict(conn.execute(sa.select(attempts.c.id, attempts.c.ray_info)).all())
        assert infos[1] == {"channel": "c1", "layer_stats": {"step": 50, "block_grad_norms": [1.5, 0.1],
                                                             "layer_grad_norms": {}, "update_ratio": None,
                                                             "diagnosis": None}}
        assert infos[2] == {"channel": "c2"}
    finally:
        engine.dispose()


@pytest.mark.slow
def test_cli_db_upgrade_uses_the_configured_url(empty_db_url: str, backend: str, tmp_path: Path) -> None:
    url = empty_db_url
    if backend == "postgresql":  # also exercises the postgresql:// -> psycopg 3 normalisation
        url = url.replace("postgresql+psycopg://", "postgresql://")
    env = {k: v for k, v in os.environ.items() if not k.startswith("BALLAST_")}
    env |= {"BALLAST_DATABASE_URL": url, "BALLAST_HOME": str(tmp_path / "home")}
    proc = subprocess.run([str(BALLAST), "db", "upgrade"], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("database at head: ")
    assert _current(empty_db_url) == _head()
    assert APP_TABLES <= _tables(empty_db_url)
    # idempotent: a second upgrade is a no-op
    again = subprocess.run([str(BALLAST), "db", "upgrade"], env=env, capture_output=True, text=True, timeout=120,
                           check=False)
    assert again.returncode == 0, again.stderr
    assert _current(empty_db_url) == _head()


@pytest.mark.slow
def test_cli_db_upgrade_defaults_to_sqlite_under_ballast_home(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BALLAST_")}
    env["BALLAST_HOME"] = str(tmp_path / "state")
    proc = subprocess.run([str(BALLAST), "db", "upgrade"], env=env, capture_output=True, text=True, timeout=120,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    db = tmp_path / "state" / "ballast.db"
    assert db.is_file()
    assert _current(f"sqlite:///{db}") == _head()

