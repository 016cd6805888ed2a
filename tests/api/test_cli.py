"""The `ballast` client commands against the real app over real HTTP, on both database backends.

A uvicorn server runs the app in a thread (no scheduler: the tests play the scheduler's part by writing to the
store, as ``seed_run`` does), and the CLI runs in-process through Typer's runner with ``--url`` pointing at it.
The one end-to-end test at the bottom starts `ballast serve` as a subprocess and watches a real run on Ray.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

import api.cli  # noqa: F401  (registers the commands)
from api.app import create_app
from api.cli.app import app as cli
from api.cli.render import sparkline
from api.cli.serve_cmd import stop_with_app
from api.cli.watch import PlainView, Tracker
from api.client import BallastClient
from orchestrator.policy.states import AttemptState, RunState
from orchestrator.settings import Settings, get_settings
from orchestrator.store import repo
from orchestrator.store.db import make_engine
from orchestrator.store.models import AnomalyRow, Attempt, EvalPoint, MetricPoint, Run
from tests.api.conftest import YAML_RECIPE, seed_attempt, settings_for
from tests.ports import free_port

BAD_RECIPE = """\
apiVersion: ballast/v1
kind: StabilityRecipe
name: bad
optimizer:
  lr: -1
  bogus: 2
"""


@pytest.fixture
def recipe_file(tmp_path: Path) -> Path:
    path = tmp_path / "demo.yaml"
    path.write_text(YAML_RECIPE)
    return path


def ballast(*args: str | Path) -> Any:
    """Run the CLI in-process; the result has exit_code, stdout and stderr."""
    return CliRunner().invoke(cli, [str(a) for a in args])


def submit_id(url: str, recipe: Path, *extra: str) -> int:
    res = ballast("submit", recipe, "--url", url, "--json", *extra)
    assert res.exit_code == 0, res.output
    return int(json.loads(res.stdout)["id"])


# -------------------------------------------------------------------------------------------- runs commands
def test_submit_prints_the_run_and_list_and_show_read_it_back(url: str, recipe_file: Path) -> None:
    res = ballast("submit", recipe_file, "--url", url)
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == "run 1 (demo): queued"
    second = submit_id(url, recipe_file)
    assert second == 2

    res = ballast("runs", "list", "--url", url, "--json")
    assert res.exit_code == 0, res.output
    page = json.loads(res.stdout)
    assert [r["id"] for r in page["data"]] == [2, 1]  # newest first
    assert page["count"] == 2 and page["next"] is None
    assert {r["state"] for r in page["data"]} == {"queued"}

    res = ballast("runs", "list", "--url", url, "--json", "--limit", "1")
    page = json.loads(res.stdout)
    assert [r["id"] for r in page["data"]] == [2] and page["next"]
    res = ballast("runs", "list", "--url", url, "--json", "--limit", "1", "--cursor", page["next"])
    assert [r["id"] for r in json.loads(res.stdout)["data"]] == [1]

    res = ballast("runs", "show", "1", "--url", url, "--json")
    assert res.exit_code == 0, res.output
    run = json.loads(res.stdout)
    assert run["id"] == 1 and run["state"] == "queued" and run["attempts"] == []
    assert run["recipe"]["training"]["max_steps"] == 100 and run["summary"]["max_steps"] == 100

    res = ballast("runs", "show", "1", "--url", url)
    assert res.exit_code == 0, res.output
    assert "run 1 demo  QUEUED" in res.stdout

    res = ballast("runs", "list", "--url", url)
    assert res.exit_code == 0, res.output
    assert "2 of 2 runs" in res.stdout


def test_list_filters_by_state_and_refuses_an_unknown_state(url: str, recipe_file: Path) -> None:
    first, second = submit_id(url, recipe_file), submit_id(url, recipe_file)
    assert ballast("runs", "cancel", str(first), "--url", url).exit_code == 0
    res = ballast("runs", "list", "--url", url, "--json", "--state", "cancelled")
    assert [r["id"] for r in json.loads(res.stdout)["data"]] == [first]
    res = ballast("runs", "list", "--url", url, "--json", "--state", "queued")
    assert [r["id"] for r in json.loads(res.stdout)["data"]] == [second]
    res = ballast("runs", "list", "--url", url, "--state", "bogus")
    assert res.exit_code == 2
    assert "bogus" in res.stderr


def test_idempotency_key_returns_the_same_run(url: str, recipe_file: Path) -> None:
    first = submit_id(url, recipe_file, "--idempotency-key", "abc-1")
    res = ballast("submit", recipe_file, "--url", url, "--idempotency-key", "abc-1")
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == f"run {first} (demo): queued (already submitted with this Idempotency-Key)"
    res = ballast("runs", "list", "--url", url, "--json")
    assert json.loads(res.stdout)["count"] == 1


def test_bad_recipe_prints_one_line_per_field_with_its_line_and_exits_2(url: str, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(BAD_RECIPE)
    res = ballast("submit", bad, "--url", url)
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [
        f"{bad}: optimizer.lr: Input should be greater than 0 (line 5)",
        f"{bad}: optimizer.bogus: unknown field (line 6)",
    ]
    assert res.stdout == ""
    assert json.loads(ballast("runs", "list", "--url", url, "--json").stdout)["count"] == 0


def test_missing_recipe_file_is_a_clear_error(url: str, tmp_path: Path) -> None:
    res = ballast("submit", tmp_path / "nope.yaml", "--url", url)
    assert res.exit_code == 2
    assert res.stderr.strip() == f"{tmp_path / 'nope.yaml'}: cannot read: No such file or directory"


def test_cancel_a_queued_run_then_cancelling_again_is_a_409_line(url: str, recipe_file: Path) -> None:
    run_id = submit_id(url, recipe_file)
    res = ballast("runs", "cancel", str(run_id), "--url", url)
    assert res.exit_code == 0, res.output
    assert res.stdout.strip() == f"run {run_id} cancelled"
    show = json.loads(ballast("runs", "show", str(run_id), "--url", url, "--json").stdout)
    assert show["state"] == "cancelled"

    res = ballast("runs", "cancel", str(run_id), "--url", url)
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: Illegal state change (409): the run is cancelled; it cannot become cancelled"


def test_cancel_an_active_run_is_a_request(
    url: str, recipe_file: Path, session_factory: sessionmaker[Session]
) -> None:
    run_id = submit_id(url, recipe_file)
    _set_run(session_factory, run_id, RunState.starting, RunState.running)
    res = ballast("runs", "cancel", str(run_id), "--url", url, "--json")
    assert res.exit_code == 0, res.output
    body = json.loads(res.stdout)
    assert body["state"] == "running" and body["cancel_requested"] is True


def test_retry_sends_lr_clip_and_set_overrides(
    url: str, recipe_file: Path, session_factory: sessionmaker[Session]
) -> None:
    run_id = submit_id(url, recipe_file)
    assert ballast("runs", "cancel", str(run_id), "--url", url).exit_code == 0
    res = ballast(
        "runs", "retry", str(run_id), "--url", url, "--lr", "1e-4", "--clip", "0.5", "--set", "training.max_steps=50"
    )
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(f"run {run_id}: queued, attempt 1 (manual)")
    show = json.loads(ballast("runs", "show", str(run_id), "--url", url, "--json").stdout)
    assert show["state"] == "queued"
    assert show["attempts"][0]["overrides"] == {
        "training.max_steps": [100, 50], "optimizer.lr": [0.003, 0.0001], "clipping.max_norm": [1.0, 0.5]
    }


def test_retry_with_a_bad_override_names_the_field(url: str, recipe_file: Path) -> None:
    run_id = submit_id(url, recipe_file)
    assert ballast("runs", "cancel", str(run_id), "--url", url).exit_code == 0
    res = ballast("runs", "retry", str(run_id), "--url", url, "--set", "optimizer.lr=-3")
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: overrides.optimizer.lr: Input should be greater than 0"
    res = ballast("runs", "retry", str(run_id), "--url", url, "--set", "no-equals-sign")
    assert res.exit_code == 2
    assert "expected PATH=VALUE" in res.stderr


def test_unknown_run_is_a_404_line(url: str) -> None:
    res = ballast("runs", "show", "99", "--url", url)
    assert res.exit_code == 2
    assert res.stderr.strip() == "error: Not Found (404): run 99 not found"


def test_connection_refused_says_to_start_the_server() -> None:
    port = free_port()  # nothing listens there
    for args in (("runs", "list"), ("submit", "-")):
        res = CliRunner().invoke(cli, [*args, "--url", f"http://127.0.0.1:{port}"], input="name: x\n")
        assert res.exit_code == 2
        assert f"cannot reach Ballast at http://127.0.0.1:{port}: is `ballast serve` running?" in res.stderr


def test_url_and_token_come_from_the_environment(
    make_server: Callable[..., str], recipe_file: Path, make_token: Callable[..., dict[str, str]]
) -> None:
    url = make_server(auth=True)
    env = {"BALLAST_URL": url}
    res = CliRunner().invoke(cli, ["runs", "list"], env=env)
    assert res.exit_code == 2
    assert "(401)" in res.stderr
    token = make_token("alice", "read", "submit")["Authorization"].removeprefix("Bearer ")
    res = CliRunner().invoke(cli, ["submit", str(recipe_file), "--json"], env={**env, "BALLAST_TOKEN": token})
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["owner"] == "alice"
    reader = make_token("bob", "read")["Authorization"].removeprefix("Bearer ")
    res = CliRunner().invoke(cli, ["submit", str(recipe_file), "--token", reader], env=env)
    assert res.exit_code == 2
    assert "(403)" in res.stderr


# -------------------------------------------------------------------------------------- anomalies, metrics
def _seed_telemetry(factory: sessionmaker[Session], run_id: int) -> None:
    """Attempt 1 with loss over 20 steps (an infinity at step 15) and two anomalies, as ingestion would store them."""
    att_id = seed_attempt(factory, run_id, 1)
    with factory() as session:
        for step in range(20):
            loss = float("inf") if step == 15 else 3.0 - step * 0.1
            session.add(MetricPoint(run_id=run_id, attempt_id=att_id, step=step, loss=loss, grad_norm=0.5, lr=1e-3))
        for seq, (step, kind) in enumerate(((12, "grad_norm_spike"), (15, "nonfinite")), start=1):
            session.add(AnomalyRow(
                run_id=run_id, attempt_id=att_id, seq=seq, step=step, kind=kind, detector=kind, value=9.5,
                threshold=6.0, action="rollback",
            ))
        session.commit()


def test_anomalies_lists_and_filters(url: str, recipe_file: Path, session_factory: sessionmaker[Session]) -> None:
    run_id = submit_id(url, recipe_file)
    _seed_telemetry(session_factory, run_id)
    res = ballast("anomalies", str(run_id), "--url", url, "--json")
    assert res.exit_code == 0, res.output
    page = json.loads(res.stdout)
    assert [(a["step"], a["kind"], a["attempt"]) for a in page["data"]] == [
        (12, "grad_norm_spike", 1), (15, "nonfinite", 1)
    ]
    res = ballast("anomalies", str(run_id), "--url", url, "--json", "--kind", "nonfinite")
    assert [a["step"] for a in json.loads(res.stdout)["data"]] == [15]
    res = ballast("anomalies", str(run_id), "--url", url)
    assert res.exit_code == 0, res.output
    assert "grad_norm_spike" in res.stdout and "2 of 2 anomalies" in res.stdout
    res = ballast("anomalies", str(run_id), "--url", url, "--kind", "bogus")
    assert res.exit_code == 2 and "kind" in res.output and "loss_spike" in res.output, res.output


def test_anomalies_say_when_a_skipped_step_was_applied_clipped(
    url: str, recipe_file: Path, session_factory: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A skip that recurred at unchanged weights is applied clipped (``details.applied_clipped_to``): the table
    says so rather than a bare ``skip_step``, which would claim the update was discarded."""
    run_id = submit_id(url, recipe_file)
    att_id = seed_attempt(session_factory, run_id, 1)
    with session_factory() as session:
        for seq, details in enumerate(({}, {"applied_clipped_to": 0.4231}), start=1):
            session.add(AnomalyRow(run_id=run_id, attempt_id=att_id, seq=seq, step=30 + seq, kind="grad_norm_spike",
                                   detector="grad_norm_spike", value=12.0, threshold=6.0, action="skip_step",
                                   details=details))
        session.commit()
    monkeypatch.setenv("COLUMNS", "160")  # a terminal wide enough that the table does not wrap its cells
    res = ballast("anomalies", str(run_id), "--url", url)
    assert res.exit_code == 0, res.output
    rows = {int(line.split()[1]): line for line in res.stdout.splitlines() if line.split()[:1] == ["1"]}
    assert rows[31].rstrip().endswith("skip_step"), rows
    assert rows[32].rstrip().endswith("skip_step → applied, clipped to 0.4231"), rows


def test_metrics_series_json_and_sparkline(
    url: str, recipe_file: Path, session_factory: sessionmaker[Session]
) -> None:
    run_id = submit_id(url, recipe_file)
    _seed_telemetry(session_factory, run_id)
    res = ballast("metrics", str(run_id), "--url", url, "--series", "loss", "--json")
    assert res.exit_code == 0, res.output
    (series,) = json.loads(res.stdout)["series"]
    assert series["name"] == "loss" and series["steps"] == list(range(20))
    assert series["values"][15] == "Infinity" and series["values"][0] == pytest.approx(3.0)

    res = ballast("metrics", str(run_id), "--url", url, "--series", "loss", "--max-points", "10")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == "loss (10 points, downsampled from 20)"
    assert "!" in lines[1]  # the spike survives downsampling and shows


def test_eval_loss_over_http_and_in_the_metrics_command(
    url: str, recipe_file: Path, session_factory: sessionmaker[Session]
) -> None:
    run_id = submit_id(url, recipe_file)
    _seed_telemetry(session_factory, run_id)
    with session_factory() as session:
        att_id = session.scalars(sa.select(Attempt.id).where(Attempt.run_id == run_id)).one()
        for step, value in ((0, 3.47), (10, 2.91), (20, 2.64)):
            session.add(EvalPoint(run_id=run_id, attempt_id=att_id, step=step, eval_loss=value))
        session.commit()
    r = httpx.get(f"{url}/api/v1/runs/{run_id}/metrics", params={"series": "eval_loss"}, timeout=10)
    assert r.status_code == 200
    assert r.json()["series"] == [{"name": "eval_loss", "steps": [0, 10, 20], "values": [3.47, 2.91, 2.64],
                                   "attempts": [1, 1, 1], "total_points": 3, "downsampled": False}]
    res = ballast("metrics", str(run_id), "--url", url, "--series", "eval_loss", "--series", "loss")
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0] == "eval_loss (3 points)"
    assert lines[1] == "█▃▁"
    assert "EVAL_LOSS" in "".join(lines[2:4])
    rows = [ln.split() for ln in lines[2:8] if ln.split() and ln.split()[0].isdigit()]
    assert rows == [["1", "0", "3.47"], ["1", "10", "2.91"], ["1", "20", "2.64"]]
    assert any(ln.startswith("loss (20 points") for ln in lines)


def test_sparkline_marks_non_finite_points() -> None:
    assert sparkline([0.0, 1.0, "NaN", 2.0]) == "▁▅!█"
    assert sparkline([]) == ""
    assert sparkline(["Infinity"]) == "!"


# ------------------------------------------------------------------------------------------------------ watch
def _set_run(factory: sessionmaker[Session], run_id: int, *states: RunState, reason: str | None = None) -> None:
    with factory() as session:
        run = session.get(Run, run_id)
        assert run is not None
        for st in states:
            repo.set_run_state(session=session, run=run, to=st, reason=reason)
        session.commit()


def _add_attempt(factory: sessionmaker[Session], run_id: int, number: int, **kw: Any) -> int:
    with factory() as session:
        att = Attempt(run_id=run_id, number=number, state="pending", **kw)
        session.add(att)
        run = session.get(Run, run_id)
        assert run is not None
        run.current_attempt = number
        session.flush()
        repo.set_attempt_state(session=session, attempt=att, to=AttemptState.running)
        session.commit()
        return att.id


def _end_attempt(factory: sessionmaker[Session], att_id: int, to: AttemptState, **kw: Any) -> None:
    with factory() as session:
        att = session.get(Attempt, att_id)
        assert att is not None
        for k, v in kw.items():
            setattr(att, k, v)
        repo.set_attempt_state(session=session, attempt=att, to=to)
        session.commit()


def _metrics(factory: sessionmaker[Session], run_id: int, att_id: int, steps: range, lr: float) -> None:
    with factory() as session:
        for step in steps:
            session.add(MetricPoint(run_id=run_id, attempt_id=att_id, step=step, loss=2.0 - step / 100,
                                    grad_norm=0.7, lr=lr))
        session.commit()


@contextmanager
def _tracking(url: str, recipe_file: Path) -> Iterator[tuple[int, list[str], Tracker]]:
    """A submitted run, the lines its watch prints, and the watch's tracker (polled by the test)."""
    run_id = submit_id(url, recipe_file)
    lines: list[str] = []
    with BallastClient(url) as client:
        yield run_id, lines, Tracker(client, run_id, PlainView(echo=lines.append))


RECOVERY_REASON = "attempt 1 diverged at step 42 (grad-norm z=9.3); resumed from step 40; lr 3e-3→1.5e-3"


def test_tracker_reports_attempts_anomalies_and_the_recovery_reason_in_order(
    url: str, recipe_file: Path, session_factory: sessionmaker[Session]
) -> None:
    """The watch logic, driven step by step: each poll reports exactly what changed in the store since the last."""
    f = session_factory
    with _tracking(url, recipe_file) as (run_id, lines, tracker):
        assert tracker.poll()["state"] == "queued"
        assert lines == [f"run {run_id} (demo): queued"]

        _set_run(f, run_id, RunState.starting, RunState.running)
        a1 = _add_attempt(f, run_id, 1)
        _metrics(f, run_id, a1, range(0, 41), 3e-3)
        lines.clear()
        tracker.poll()
        assert lines == [
            f"run {run_id} (demo): running",
            "attempt 1 started (initial)",
            "attempt 1 step 40/100 loss 1.6 grad_norm 0.7 lr 0.003",
        ]

        with f() as session:
            session.add(AnomalyRow(run_id=run_id, attempt_id=a1, seq=50, step=42, kind="grad_norm_spike",
                                   detector="grad_norm_spike", value=93.1, threshold=10.0, action="rollback"))
            session.commit()
        _end_attempt(f, a1, AttemptState.diverged, last_step=42, onset_step=42,
                     outcome={"reason": "grad-norm spike z=9.3 at step 42"})
        _set_run(f, run_id, RunState.recovering, reason="attempt 1 diverged at step 42")
        a2 = _add_attempt(f, run_id, 2, kind="numeric_retry", resume_step=40, reason=RECOVERY_REASON)
        _set_run(f, run_id, RunState.running)
        lines.clear()
        tracker.poll()
        assert lines == [
            "anomaly: attempt 1 step 42: grad_norm_spike value 93.1 > 10, action rollback",
            "attempt 1 diverged (last step 42): grad-norm spike z=9.3 at step 42",
            "attempt 2 started (numeric_retry, from step 40)",
            f"recovery: {RECOVERY_REASON}",
        ]

        _metrics(f, run_id, a2, range(40, 100), 1.5e-3)
        _end_attempt(f, a2, AttemptState.succeeded, last_step=99)
        _set_run(f, run_id, RunState.succeeded)
        lines.clear()
        assert tracker.poll()["state"] == "succeeded"
        assert lines == [
            "attempt 2 step 99/100 loss 1.01 grad_norm 0.7 lr 0.0015",
            "attempt 2 succeeded (last step 99)",
        ]
        lines.clear()
        tracker.poll()
        assert lines == []  # nothing new: nothing reported twice


PROBED = "lr probe from step 40: 0.0015 → loss 1.5; 0.000375 → loss 1.6; chose 0.0015 (lowest loss)"


def test_tracker_says_what_a_retrys_lr_probe_chose_once_it_has(
    url: str, recipe_file: Path, session_factory: sessionmaker[Session]
) -> None:
    """A retry's LR probe runs after the retry is shown: its result, appended to the reason, is its own line."""
    f = session_factory
    with _tracking(url, recipe_file) as (run_id, lines, tracker):
        _set_run(f, run_id, RunState.starting, RunState.running)
        a1 = _add_attempt(f, run_id, 1)
        _end_attempt(f, a1, AttemptState.diverged, last_step=42, onset_step=42)
        planned = {"rewarm_steps": 20, "lr_probe": {"candidates": [1.5e-3, 3.75e-4], "steps": 10}}
        a2 = _add_attempt(f, run_id, 2, kind="numeric_retry", resume_step=40, reason=RECOVERY_REASON, plan=planned)
        tracker.poll()
        assert lines[-1] == f"recovery: {RECOVERY_REASON}"

        lines.clear()
        tracker.poll()
        assert lines == []  # the probe has not chosen yet
        with f() as session:
            att = session.get(Attempt, a2)
            assert att is not None
            att.plan = {**planned, "lr_probe": {**planned["lr_probe"], "chosen": 1.5e-3, "steps_run": 20}}
            att.reason = f"{RECOVERY_REASON}; {PROBED}"
            session.commit()
        tracker.poll()
        assert lines == [f"lr probe: {PROBED}"]
        lines.clear()
        tracker.poll()
        assert lines == []


def test_submit_watch_follows_a_failing_run_and_exits_1(
    url: str, recipe_file: Path, session_factory: sessionmaker[Session]
) -> None:
    """`submit --watch` end to end over HTTP; a thread plays the scheduler, and the run fails."""
    f = session_factory

    def scheduler() -> None:
        while True:
            with f() as session:
                if session.get(Run, 1) is not None:
                    break
            time.sleep(0.05)
        _set_run(f, 1, RunState.starting, RunState.running)
        a1 = _add_attempt(f, 1, 1)
        _metrics(f, 1, a1, range(0, 10), 3e-3)
        _end_attempt(f, a1, AttemptState.crashed, last_step=9, outcome={"error": "worker died (SIGKILL)"})
        _set_run(f, 1, RunState.failed, reason="crash restarts exhausted (0 of 0)")

    thread = threading.Thread(target=scheduler, daemon=True)
    thread.start()
    res = ballast("submit", recipe_file, "--watch", "--url", url)
    thread.join(timeout=30)
    assert res.exit_code == 1, res.output
    out = res.stdout.splitlines()
    assert "attempt 1 started (initial)" in out
    assert "attempt 1 crashed (last step 9): worker died (SIGKILL)" in out
    assert out[-1] == "run 1 FAILED (1 attempt, 0 retries): crash restarts exhausted (0 of 0)"


def test_runs_watch_json_on_a_finished_run_prints_it_and_exits_1(url: str, recipe_file: Path) -> None:
    run_id = submit_id(url, recipe_file)
    assert ballast("runs", "cancel", str(run_id), "--url", url).exit_code == 0
    res = ballast("runs", "watch", str(run_id), "--url", url, "--json")
    assert res.exit_code == 1, res.output
    body = json.loads(res.stdout)
    assert body["id"] == run_id and body["state"] == "cancelled"


# ------------------------------------------------------------------------------------------- ballast serve
BALLAST = [str(Path(sys.executable).parent / "ballast")]


def _serve_env(home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BALLAST_")}
    return {**env, "BALLAST_HOME": str(home), **extra}


def _wait_healthy(url: str, proc: subprocess.Popen[str], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"ballast serve exited early: {proc.communicate()[1][-3000:]}"
        try:
            with BallastClient(url, retries=0) as client:
                client.health()
            return
        except Exception:
            time.sleep(0.2)
    raise AssertionError("ballast serve did not become healthy")


@pytest.mark.slow  # starts `ballast serve` in a subprocess (imports the whole stack: seconds)
def test_serve_refuses_a_public_bind_without_auth(tmp_path: Path) -> None:
    proc = subprocess.run(
        [*BALLAST, "serve", "--host", "0.0.0.0"], env=_serve_env(tmp_path), capture_output=True, text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "ballast: refusing to start: BALLAST_AUTH_MODE=off is only allowed on a loopback bind, not '0.0.0.0'; "
        "set BALLAST_AUTH_MODE=token"
    )
    assert not (tmp_path / "ballast.db").exists()  # refused before touching anything


@pytest.mark.slow  # starts `ballast serve` in a subprocess (imports the whole stack: seconds)
def test_serve_refuses_an_unreachable_database(tmp_path: Path) -> None:
    port = free_port()
    proc = subprocess.run(
        [*BALLAST, "serve", "--no-scheduler"],
        env=_serve_env(tmp_path, BALLAST_DATABASE_URL=f"postgresql://nobody@127.0.0.1:{port}/x"),
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith(
        f"ballast: refusing to start: cannot migrate the database at postgresql+psycopg://nobody@127.0.0.1:{port}/x:"
    )
    assert "Traceback" not in proc.stderr


@pytest.mark.slow  # starts `ballast serve` in a subprocess (imports the whole stack: seconds)
def test_serve_migrates_a_fresh_home_serves_and_stops_cleanly_on_sigterm(tmp_path: Path, recipe_file: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [*BALLAST, "serve", "--no-scheduler", "--port", str(port), "--log-level", "warning"],
        env=_serve_env(tmp_path / "home"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        _wait_healthy(url, proc)
        run_id = submit_id(url, recipe_file)
        res = ballast("runs", "show", str(run_id), "--url", url, "--json")
        assert json.loads(res.stdout)["state"] == "queued"
        assert (tmp_path / "home" / "ballast.db").exists()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err
    assert "Traceback" not in err



class FakeScheduler:
    """Stands in for orchestrator.scheduler.Scheduler: records start/stop; run_forever waits for stop()."""

    instances: list[FakeScheduler] = []

    def __init__(self, settings: Settings, session_factory: sessionmaker[Session]) -> None:
        self.settings = settings
        self.calls: list[str] = []
        self.stopped = threading.Event()
        FakeScheduler.instances.append(self)

    def start(self) -> None:
        self.calls.append("start")

    def stop(self, timeout: float = 30.0) -> None:
        self.calls.append("stop")
        self.stopped.set()

    def run_forever(self, on_running: Any = None) -> None:
        self.calls.append("run_forever")
        if on_running is not None:
            on_running()
        os.kill(os.getpid(), signal.SIGTERM)  # what `kill` or Kubernetes sends
        assert self.stopped.wait(10), "SIGTERM did not stop the scheduler"


def test_scheduler_command_migrates_runs_and_stops_on_sigterm(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import orchestrator.scheduler

    monkeypatch.setattr(orchestrator.scheduler, "Scheduler", FakeScheduler)
    for key in [k for k in os.environ if k.startswith("BALLAST_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("BALLAST_HOME", str(tmp_path))
    get_settings.cache_clear()
    FakeScheduler.instances.clear()
    previous = signal.getsignal(signal.SIGTERM)
    try:
        res = CliRunner().invoke(cli, ["scheduler"])
    finally:
        get_settings.cache_clear()
    assert res.exit_code == 0, res.output
    (sched,) = FakeScheduler.instances
    assert sched.calls == ["run_forever", "stop"]
    assert sched.settings.database_url == f"sqlite:///{tmp_path.as_posix()}/ballast.db"
    assert "ballast: scheduler stopped" in res.stderr
    assert signal.getsignal(signal.SIGTERM) == previous  # handlers restored
    engine = make_engine(sched.settings.database_url)
    try:
        assert "runs" in sa.inspect(engine).get_table_names()  # migrated before the scheduler started
    finally:
        engine.dispose()


def test_the_scheduler_stops_when_the_app_shuts_down(db_url: str, tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    sched = FakeScheduler(settings_for(db_url, tmp_path), None)  # type: ignore[arg-type]
    app = create_app(settings_for(db_url, tmp_path), hooks=[stop_with_app(sched)])
    with TestClient(app) as client:
        assert client.get("/healthz").json() == {"status": "ok"}
        assert sched.calls == []
    assert sched.calls == ["stop"]


# ------------------------------------------------------------------------------------------ end to end (Ray)
REPO = Path(__file__).resolve().parents[2]
UNSTABLE_RECIPE = REPO / "recipes" / "unstable-grad-spike.yaml"


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_serve_and_submit_watch_show_a_run_diverge_recover_and_succeed(ray_cluster: Any, tmp_path: Path) -> None:
    """`ballast serve` (API + scheduler) as a subprocess, then `ballast submit --watch` on an unstable example.

    The server joins this test session's Ray (one Ray per session) through BALLAST_RAY_ADDRESS; everything else
    is the default local setup: SQLite under BALLAST_HOME, auth off on loopback.
    """
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = _serve_env(tmp_path / "home", BALLAST_RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address,
                     BALLAST_SCHEDULER_POLL_SECONDS="0.3")
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([*BALLAST, "serve", "--port", str(port), "--log-level", "warning"], env=env,
                                stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_healthy(url, proc, timeout=180)
        watch = subprocess.run([*BALLAST, "submit", str(UNSTABLE_RECIPE), "--watch", "--url", url],
                               env=env, capture_output=True, text=True, timeout=800)
        out = watch.stdout.splitlines()
        diag = f"watch output:\n{watch.stdout}\n{watch.stderr}\nserver log:\n{log_path.read_text()[-4000:]}"
        assert watch.returncode == 0, diag

        show = subprocess.run([*BALLAST, "runs", "show", "1", "--json", "--url", url], env=env,
                              capture_output=True, text=True, timeout=60)
        run = json.loads(show.stdout)
        listed = json.loads(subprocess.run([*BALLAST, "runs", "list", "--json", "--url", url], env=env,
                                           capture_output=True, text=True, timeout=60).stdout)
        anomalies = json.loads(subprocess.run([*BALLAST, "anomalies", "1", "--json", "--url", url], env=env,
                                              capture_output=True, text=True, timeout=60).stdout)["data"]
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, log_path.read_text()[-4000:]

    assert run["state"] == "succeeded" and [r["id"] for r in listed["data"]] == [1]
    first, second = run["attempts"][0], run["attempts"][1]
    assert first["state"] == "diverged" and second["kind"] == "numeric_retry" and second["reason"]
    assert run["attempts"][-1]["state"] == "succeeded"
    # the divergence, then the recovery reason (exactly as stored), then success
    ended = f"attempt 1 diverged (last step {first['last_step']})"
    diverged = out.index(next(line for line in out if line.startswith(ended)))
    recovery = out.index(next(line for line in out if line.startswith("recovery: ")))
    assert diverged < recovery < len(out) - 1, diag
    shown = out[recovery].removeprefix("recovery: ")
    if shown != second["reason"]:  # its LR probe chose after the retry was shown: then said on its own line
        probe = next(line for line in out[recovery:] if line.startswith("lr probe: "))
        assert second["reason"] == f"{shown}; {probe.removeprefix('lr probe: ')}", diag
        assert second["plan"]["lr_probe"]["chosen"] is not None
    assert out[-1].startswith(f"run 1 SUCCEEDED ({len(run['attempts'])} attempts"), diag
    # every anomaly in the store was shown as it arrived, and attempt 1 had at least one
    shown = [line for line in out if line.startswith("anomaly: ")]
    assert [a for a in anomalies if a["attempt"] == 1]
    assert len(shown) == len(anomalies), diag
    # progress lines from both attempts
    assert any(line.startswith("attempt 1 step ") for line in out) and any(
        line.startswith(f"attempt {len(run['attempts'])} step ") for line in out), diag
