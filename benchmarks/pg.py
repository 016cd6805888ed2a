"""A throwaway PostgreSQL database for a benchmark: created on entry, dropped (with its connections) on exit.

Shared by ``bench_api.py`` and ``bench_ingest.py`` (each run as a script, so this directory is on ``sys.path``).
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import sqlalchemy as sa

PG_ADMIN_URL = os.environ.get("BALLAST_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/postgres")


@contextmanager
def pg_database(prefix: str = "ballast_bench") -> Iterator[str]:
    """The URL of a fresh database named ``<prefix>_<random>`` on the tests' PostgreSQL server."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'CREATE DATABASE "{name}"'))
    url = sa.engine.make_url(PG_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    try:
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()
