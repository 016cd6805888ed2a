"""Quiet logs for what is expected: a database outage is one line per failed tick (the first a warning with the
cause, repeats rate-limited, the recovery once), never a traceback; `ballast scheduler` stops on SIGTERM with
status 0 and no stack dump. The outage is real: a PostgreSQL database of this test's own that stops taking
connections (``ALLOW_CONNECTIONS false`` and its backends terminated), then takes them again."""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import migrations
from orchestrator.scheduler import Scheduler
from orchestrator.scheduler.outage import REPEAT_WARNING_S, OutageLog, is_outage
from orchestrator.store.db import make_engine, make_session_factory, transaction
from orchestrator.store.models import MetricPoint
from tests.conftest import PG_ADMIN_URL, create_pg_database, drop_pg_database
from tests.orchestrator.fakes import FakeLauncher, make_settings, submit

WAIT_S = 120.0  # generous bounds on waiting for a log line; nothing asserts on time


def _records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "ballast.scheduler"]


def test_an_outage_is_one_warning_then_rate_limited_lines_then_one_recovery_line(
    caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    log = logging.getLogger("ballast.scheduler")
    outage = OutageLog(log, clock=lambda: now[0])
    caplog.set_level(logging.DEBUG, logger="ballast.scheduler")
    err = sa.exc.OperationalError("SELECT 1", {}, Exception('connection failed: FATAL:  database "x" is not\n'
                                                            "currently accepting connections"))
    assert is_outage(err) and not is_outage(ValueError("a bug"))
    outage.succeeded()
    assert _records(caplog) == []  # nothing to recover from
    for _ in range(5):
        outage.failed(err)
        now[0] += REPEAT_WARNING_S / 4
    outage.failed(err)
    outage.succeeded()
    outage.succeeded()
    lines = [(r.levelname, r.getMessage()) for r in _records(caplog)]
    assert lines[0] == ("WARNING", 'scheduler: the database is unreachable (connection failed: FATAL:  database "x" '
                                   "is not); retrying every tick")
    assert [lvl for lvl, _ in lines] == ["WARNING", "DEBUG", "DEBUG", "DEBUG", "WARNING", "DEBUG", "INFO"]
    assert lines[4][1].startswith("scheduler: the database is still unreachable after 60 s (5 failed ticks)")
    assert lines[-1] == ("INFO", "scheduler: the database is reachable again after 75 s (6 failed ticks)")
    assert all("\n" not in msg for _, msg in lines) and all(r.exc_info is None for r in _records(caplog))


@pytest.fixture
def pg_database() -> Iterator[str]:
    url = create_pg_database("ballast_outage")
    migrations.upgrade(url)
    yield url
    _allow_connections(url, True)
    drop_pg_database(url)


def _allow_connections(url: str, allow: bool) -> None:
    name = sa.engine.make_url(url).database
    admin = sa.create_engine(PG_ADMIN_URL, isolation_level="AUTOCOMMIT")
    with admin.connect() as conn:
        conn.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {"true" if allow else "false"}'))
        if not allow:
            conn.execute(sa.text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                                 "WHERE datname = :name AND pid <> pg_backend_pid()"), {"name": name})
    admin.dispose()


def _wait_for(caplog: pytest.LogCaptureFixture, text: str, count: int = 1) -> None:
    stop_at = time.monotonic() + WAIT_S
    while sum(text in r.getMessage() for r in _records(caplog)) < count:
        assert time.monotonic() < stop_at, f"no {count}x {text!r} in {[r.getMessage() for r in _records(caplog)]}"
        time.sleep(0.1)


@pytest.mark.postgres
def test_a_real_database_outage_logs_one_line_per_failed_tick_and_its_recovery_once(
    pg_database: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(pg_database)
    factory = make_session_factory(engine)
    launcher = FakeLauncher()
    scheduler = Scheduler(make_settings(pg_database, tmp_path), factory, "sched-outage", launcher=launcher)
    run_id = submit(factory)
    caplog.set_level(logging.DEBUG, logger="ballast.scheduler")
    scheduler.start()
    try:
        stop_at = time.monotonic() + WAIT_S
        while not launcher.of_run(run_id):
            assert time.monotonic() < stop_at
            time.sleep(0.1)
        ch = launcher.of_run(run_id)[0]
        ch.metrics(1, range(5))
        caplog.clear()
        _allow_connections(pg_database, False)
        _wait_for(caplog, "tick failed, the database is unreachable", count=3)
        ch.metrics(1, range(5, 10))  # training goes on; the channel holds the events
        _allow_connections(pg_database, True)
        _wait_for(caplog, "the database is reachable again")
        stop_at = time.monotonic() + WAIT_S
        while True:
            with transaction(factory) as s:
                steps = s.scalar(sa.select(sa.func.count()).select_from(MetricPoint)
                                 .where(MetricPoint.run_id == run_id))
            if steps == 10:
                break
            assert time.monotonic() < stop_at, steps
            time.sleep(0.1)
    finally:
        scheduler.stop()
        engine.dispose()
    records = _records(caplog)
    messages = [r.getMessage() for r in records]
    assert all(r.exc_info is None for r in records), messages  # no traceback, from any part of the tick
    warnings = [m for r, m in zip(records, messages, strict=True) if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith("scheduler: the database is unreachable ("), messages
    # the driver's words, whichever the outage hit first (a terminated connection, a refused new one)
    assert re.fullmatch(r"scheduler: the database is unreachable \((.*(connection|accepting).*)\); retrying every tick",
                        warnings[0]), warnings
    assert sum("reachable again" in m for m in messages) == 1
    assert all("\n" not in m for m in messages)


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ballast_scheduler_exits_0_on_sigterm_without_a_stack_dump(tmp_path: Path) -> None:
    """Its own local Ray, as `ballast scheduler` runs by default; SIGTERM to the process, as `kill` or Kubernetes
    sends it."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BALLAST_") and k != "RAY_ADDRESS"}
    env.update(BALLAST_HOME=str(tmp_path), BALLAST_RAY_NUM_CPUS="1")
    err_path = tmp_path / "stderr.log"
    with err_path.open("w") as err:
        proc = subprocess.Popen([str(Path(sys.executable).parent / "ballast"), "scheduler"], env=env,
                                stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        stop_at = time.monotonic() + 240
        while "ballast: scheduler running" not in err_path.read_text():  # Ray connected, its handler replaced
            assert proc.poll() is None and time.monotonic() < stop_at, err_path.read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
    stderr = err_path.read_text()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr and "stack" not in stderr.lower() and "SIGTERM received" not in stderr, stderr
    assert stderr.rstrip().endswith("ballast: scheduler stopped")


@pytest.mark.postgres
def test_the_api_answers_503_with_retry_after_during_the_outage_and_200_after(pg_database: str, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from api.app import create_app
    from orchestrator.settings import Settings

    engine = make_engine(pg_database)
    app = create_app(Settings(home=tmp_path, database_url=pg_database), make_session_factory(engine))
    try:
        with TestClient(app) as client:
            assert client.get("/api/v1/runs").status_code == 200
            _allow_connections(pg_database, False)
            r = client.get("/api/v1/runs")
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.headers["content-type"].startswith("application/problem+json")
            _allow_connections(pg_database, True)
            assert client.get("/api/v1/runs").status_code == 200
    finally:
        engine.dispose()
