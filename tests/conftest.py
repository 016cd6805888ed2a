"""Shared fixtures: databases on both backends (SQLite and the real PostgreSQL), and one Ray per session.

Store, API and migration tests take ``db_url`` / ``session_factory`` and so run once per backend. PostgreSQL
databases are created fresh for this test session (random names) and dropped at the end.
``BALLAST_TEST_BACKENDS=sqlite`` limits a quick local run to SQLite.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import settings as hypothesis_settings
from sqlalchemy.orm import Session, sessionmaker

import migrations
from orchestrator.store.db import make_engine, make_session_factory
from orchestrator.store.models import Base

# Every property test is deterministic: the same examples on every run and machine (a flaky test is a bug), and no
# example database carried between runs. Tests may raise max_examples or lift health checks; they inherit this.
hypothesis_settings.register_profile("ballast", derandomize=True, database=None, deadline=None)
hypothesis_settings.load_profile("ballast")

PG_ADMIN_URL = os.environ.get("BALLAST_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")
_BACKENDS = os.environ.get("BALLAST_TEST_BACKENDS", "sqlite,postgresql").split(",")
BACKEND_PARAMS = [
    pytest.param(b, marks=[pytest.mark.postgres] if b == "postgresql" else [], id=b) for b in _BACKENDS if b
]


def _pg_url(dbname: str) -> str:
    return str(sa.engine.make_url(PG_ADMIN_URL).set(database=dbname).render_as_string(hide_password=False))


def create_pg_database(prefix: str = "ballast_test") -> str:
    """Create a fresh PostgreSQL database and return its URL."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    admin.dispose()
    return _pg_url(name)


def drop_pg_database(url: str) -> None:
    name = sa.engine.make_url(url).database
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
    admin.dispose()


@pytest.fixture(autouse=True, scope="session")
def _one_torch_thread() -> None:
    """Tiny models run 10-50x slower on a shared 2-core machine when torch spreads each op over threads."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a hard dependency
        return
    torch.set_num_threads(1)


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def empty_db_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A brand-new empty database (for migration tests)."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
        return
    url = create_pg_database("ballast_mig")
    try:
        yield url
    finally:
        drop_pg_database(url)


@pytest.fixture(scope="session")
def _migrated_templates(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """One migrated database per backend for the session; tests get a copy (SQLite) or a truncated DB (PG)."""
    templates: dict[str, str] = {}
    if "sqlite" in _BACKENDS:
        path = tmp_path_factory.mktemp("sqlite-template") / "template.db"
        migrations.upgrade(f"sqlite:///{path}")
        templates["sqlite"] = str(path)
    if "postgresql" in _BACKENDS:
        url = create_pg_database()
        migrations.upgrade(url)
        templates["postgresql"] = url
    yield templates
    if "postgresql" in templates:
        drop_pg_database(templates["postgresql"])


def _truncate_all(url: str) -> None:
    engine = make_engine(url, poolclass=sa.pool.NullPool)
    tables = ", ".join(f'"{t.name}"' for t in Base.metadata.sorted_tables)
    with engine.begin() as conn:
        conn.execute(sa.text(f"TRUNCATE {tables} RESTART IDENTITY CASCADE"))
    engine.dispose()


@pytest.fixture
def db_url(backend: str, tmp_path: Path, _migrated_templates: dict[str, str]) -> Iterator[str]:
    """A migrated, empty database on ``backend``."""
    if backend == "sqlite":
        dest = tmp_path / "ballast.db"
        shutil.copyfile(_migrated_templates["sqlite"], dest)
        yield f"sqlite:///{dest}"
        return
    url = _migrated_templates["postgresql"]
    _truncate_all(url)
    yield url
    _truncate_all(url)


@pytest.fixture
def engine(db_url: str) -> Iterator[sa.Engine]:
    eng = make_engine(db_url)
    yield eng
    eng.dispose()


@pytest.fixture
def session_factory(engine: sa.Engine) -> sessionmaker[Session]:
    return make_session_factory(engine)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    """The one local Ray instance of the test session (2 CPUs)."""
    import ray

    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"RAY_TRAIN_V2_ENABLED": "1"}})
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def _ray_cpus_given_back(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test on the session's Ray: every CPU is free again. A placement group left behind (a killed
    creator's is kept for the life of the job) would starve every later test that needs the CPUs until its own
    timeout, so the leak is removed here and fails the test that left it."""
    yield
    if "ray_cluster" not in request.fixturenames:
        return
    import ray

    if not ray.is_initialized() or all_ray_cpus_free_soon():
        return
    removed = remove_every_placement_group()
    freed = all_ray_cpus_free_soon(30.0)  # removal is asynchronous: the next test must find the CPUs free
    pytest.fail(f"the test left {removed} placement group(s) holding the session Ray's CPUs (removed now; "
                f"{'every CPU free again' if freed else 'still not every CPU free'})")


def all_ray_cpus_free_soon(timeout_s: float = 60.0) -> bool:
    """Every CPU of the session's Ray is free within ``timeout_s`` (freeing a killed group takes a moment)."""
    import time

    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        free, total = ray.available_resources(), ray.cluster_resources()  # type: ignore[no-untyped-call]
        if free.get("CPU", 0.0) >= total.get("CPU", 0.0):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)


def remove_every_placement_group() -> int:
    """Remove every placement group not yet removed; how many there were."""
    import ray
    from ray.util import placement_group_table, remove_placement_group
    from ray.util.placement_group import PlacementGroup

    live = [pg_id for pg_id, entry in placement_group_table().items() if entry["state"] != "REMOVED"]
    for pg_id in live:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    return len(live)
