"""The CLI as a new user reads it: 80 columns, no tracebacks on a fresh database, headers, one step convention.

Each test drives the real commands (typer's CliRunner) against a real database on both backends, or against the
real app over HTTP; the 80-column ones set ``COLUMNS=80``, which rich reads as the terminal width.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

import api.cli  # noqa: F401  (registers the commands)
import migrations
from api.cli.app import app
from orchestrator.settings import get_settings
from orchestrator.store.models import Attempt, Run
from tests.api.conftest import PEPPER, seed_attempt, seed_run


def run_cli(*args: str, columns: int = 80) -> Any:
    return CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns)})


@pytest.fixture
def fresh_db(empty_db_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A database that nothing has migrated yet (as on a machine where `serve` never ran)."""
    monkeypatch.setenv("BALLAST_DATABASE_URL", empty_db_url)
    monkeypatch.setenv("BALLAST_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("BALLAST_TOKEN_PEPPER", PEPPER)
    get_settings.cache_clear()
    yield empty_db_url
    get_settings.cache_clear()


def test_token_commands_migrate_a_fresh_database_first(fresh_db: str) -> None:
    listed = run_cli("token", "list")
    assert listed.exit_code == 0, listed.output
    assert "Traceback" not in listed.output and "no such table" not in listed.output
    assert "no tokens" in listed.stdout
    created = run_cli("token", "create", "--name", "first-admin", "--scope", "admin")
    assert created.exit_code == 0, created.output
    assert created.stdout.strip().splitlines()[-1].startswith("blst_")


def test_token_list_has_a_header_and_one_row_per_token(fresh_db: str) -> None:
    for name in ("ci", "alice-laptop"):
        assert run_cli("token", "create", "--name", name, "--scope", "read").exit_code == 0
    assert run_cli("token", "revoke", "1").exit_code == 0
    out = run_cli("token", "list").stdout.splitlines()
    assert out[0].split() == ["ID", "NAME", "PRINCIPAL", "SCOPES", "STATE", "CREATED"]
    rows = [line.split() for line in out[1:]]
    assert [(r[0], r[1], r[4]) for r in rows] == [("1", "ci", "revoked"), ("2", "alice-laptop", "active")]
    assert all(len(line) <= 80 for line in out)


def test_db_current_says_when_there_is_no_schema_and_when_it_is_at_head(fresh_db: str) -> None:
    empty = run_cli("db", "current")
    assert empty.exit_code == 0, empty.output
    assert "no schema yet" in empty.stdout and "ballast db upgrade" in empty.stdout
    migrations.upgrade(fresh_db)
    at_head = run_cli("db", "current")
    assert at_head.exit_code == 0 and "(head)" in at_head.stdout, at_head.output


def test_db_current_on_an_unreachable_database_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALLAST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:1/nothing")
    get_settings.cache_clear()
    try:
        res = run_cli("db", "current")
    finally:
        get_settings.cache_clear()
    assert res.exit_code == 2 and "cannot read the database" in res.output and "Traceback" not in res.output


# ------------------------------------------------------------------------------------- reading runs at 80 cols
def _recovered_run(factory: sessionmaker[Session], name: str) -> int:
    """A run whose attempt 1 diverged (a detector's reason with its numbers) and attempt 2 recovered, with
    three overrides: the rows the scheduler would leave."""
    run_id = seed_run(factory, name=name, state="succeeded")
    seed_attempt(factory, run_id, 1, state="diverged")
    seed_attempt(factory, run_id, 2, state="succeeded", kind="numeric_retry",
                 overrides={"optimizer.lr": [0.1, 0.05], "clipping.max_norm": [1.0, 0.5],
                            "schedule.warmup_steps": [0, 20]})
    with factory() as s:
        a1, a2 = sorted(s.query(Attempt).filter(Attempt.run_id == run_id), key=lambda a: a.number)
        a1.last_step, a1.onset_step = 63, 61
        a1.outcome = {"reason": "loss_spike detected at step 63, onset at step 61: value 9.579 vs threshold 7.319; "
                                "rolled back", "onset_step": 61, "detector": "loss_spike"}
        a2.last_step, a2.resume_step = 99, 50
        a2.reason = "attempt 1 diverged (onset at step 61, loss_spike=9.58); resumed from step 50; lr 0.1→0.05"
        run = s.get(Run, run_id)
        assert run is not None
        run.current_attempt, run.last_step, run.best_loss, run.retries_used = 2, 99, 2.1780000001, 1
        s.commit()
    return run_id


def test_runs_list_fits_80_columns_with_every_short_column_whole(
    url: str, session_factory: sessionmaker[Session]
) -> None:
    run_id = _recovered_run(session_factory, "an-unusually-long-run-name-for-a-listing")
    res = run_cli("runs", "list", "--url", url)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert all(len(line) <= 80 for line in lines), lines
    assert lines[0].split() == ["ID", "NAME", "STATE", "ATT", "RETRY", "STEP", "BEST", "ANOM", "CREATED"]
    row = next(line for line in lines[1:] if line.split()[0] == str(run_id)).split()
    # the name gives way (ellipsis); state, counts, step, loss (4 significant digits) and time stay whole
    assert row[1].endswith("…") and row[2] == "succeeded" and row[3:7] == ["2", "1", "99/100", "2.178"]
    assert len(row[-2]) == 5 and len(row[-1]) == 5  # MM-DD HH:MM


def test_runs_show_prints_whole_reasons_under_a_table_that_fits_80_columns(
    url: str, session_factory: sessionmaker[Session]
) -> None:
    run_id = _recovered_run(session_factory, "recovered")
    res = run_cli("runs", "show", str(run_id), "--url", url)
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["#", "KIND"])
    table_lines = [line for line in lines[header:] if not line.startswith("attempt ")]
    assert all(len(line) <= 80 for line in table_lines), table_lines
    # each reason whole on one line (a terminal wraps it; a log or grep gets it intact), step words unambiguous
    assert ("attempt 1 ended: loss_spike detected at step 63, onset at step 61: value 9.579 vs threshold 7.319; "
            "rolled back") in lines
    assert "attempt 2 started: attempt 1 diverged (onset at step 61, loss_spike=9.58); resumed from step 50; lr " \
           "0.1→0.05" in lines
    assert any("schedule.warmup_steps 0→20" in line for line in table_lines)


def test_output_to_a_pipe_has_no_ansi_codes(url: str, session_factory: sessionmaker[Session]) -> None:
    run_id = _recovered_run(session_factory, "piped")
    for args in (("runs", "list"), ("runs", "show", str(run_id)), ("anomalies", str(run_id))):
        res = run_cli(*args, "--url", url)
        assert res.exit_code == 0, res.output
        assert "\x1b[" not in res.output, args


def test_anomalies_refuses_an_unknown_kind_naming_the_known_ones(
    url: str, session_factory: sessionmaker[Session]
) -> None:
    run_id = _recovered_run(session_factory, "kinds")
    res = run_cli("anomalies", str(run_id), "--url", url, "--kind", "loss_spik")
    assert res.exit_code == 2, res.output
    assert "kind" in res.output and "loss_spike" in res.output
    ok = run_cli("anomalies", str(run_id), "--url", url, "--kind", "loss_spike", "--json")
    assert ok.exit_code == 0 and json.loads(ok.stdout)["data"] == []


# ------------------------------------------------------------------------------------------ ballast train --steps
REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_train_steps_scales_a_step_count_warmup(tmp_path: Path) -> None:
    """`--steps 20` on a recipe with `warmup_steps: 30` of 300 trains with a 2-step warmup instead of refusing."""
    res = CliRunner().invoke(app, ["train", str(REPO / "recipes/baseline.yaml"), "--steps", "20",
                                   "--checkpoint-dir", str(tmp_path / "ckpt"), "--json"])
    assert res.exit_code in (0, 1), res.output  # the run's verdict is not the point; that it ran is
    assert "schedule.warmup_steps 30 → 2" in res.stderr
    out = json.loads(res.stdout)
    assert out["final_step"] == 20


def test_train_steps_that_a_fault_outlives_name_the_flag(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["train", str(REPO / "recipes/unstable-grad-spike.yaml"), "--steps", "30",
                                   "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert res.exit_code == 2
    assert "faults.0.step" in res.output and "with --steps 30" in res.output and "Traceback" not in res.output
