"""Load while runs train: `ballast serve` (PostgreSQL, the session's Ray) trains two runs while 32 clients submit
200 runs, each submission sent a second time with the same Idempotency-Key (what a client does after a lost
response). Every request must succeed, and every key must make exactly one run. The submission latencies are
printed (p50/p99, for BENCHMARKS.md); nothing asserts on them."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import yaml

from tests.api.test_cli import BALLAST, _serve_env, _wait_healthy
from tests.conftest import create_pg_database, drop_pg_database
from tests.ports import free_port
from tests.recipes import recipe_doc

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(900)]

CLIENTS, SUBMISSIONS = 32, 200
TRAINING = recipe_doc(
    {"name": "trains-under-load",
     "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 1, "n_heads": 2, "d_model": 32},
     "data": {"name": "markov", "vocab_size": 32, "seq_len": 16},
     "training": {"max_steps": 100_000, "batch_size": 8},
     "checkpoint": {"every_steps": 50, "keep": 2}},
)
SUBMITTED = yaml.safe_dump(recipe_doc({"name": "load"}))
WAIT_S = 300.0


@pytest.fixture
def pg_url() -> Iterator[str]:
    url = create_pg_database("ballast_load")
    yield url
    drop_pg_database(url)


def _submit(client: httpx.Client, text: str, key: str) -> httpx.Response:
    return client.post("/api/v1/runs", content=text,
                       headers={"Content-Type": "application/yaml", "Idempotency-Key": key})


def _wait_state(client: httpx.Client, run_id: int, states: set[str]) -> None:
    stop_at = time.monotonic() + WAIT_S
    while client.get(f"/api/v1/runs/{run_id}").json()["state"] not in states:
        assert time.monotonic() < stop_at, f"run {run_id} never reached {states}"
        time.sleep(0.5)


def test_200_submissions_from_32_clients_while_runs_train_fail_none_and_duplicate_none(
    ray_cluster: Any, pg_url: str, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = _serve_env(tmp_path / "home", BALLAST_DATABASE_URL=pg_url, BALLAST_MAX_CONCURRENT_RUNS="2",
                     BALLAST_RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address)
    log = tmp_path / "serve.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*BALLAST, "serve", "--port", str(port), "--log-level", "warning"], env=env,
                                stdout=out, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    results: list[tuple[int, int, int, int, float]] = []
    training: list[int] = []
    try:
        _wait_healthy(url, proc, timeout=240)
        with httpx.Client(base_url=url, timeout=60) as client:
            training = [_submit(client, yaml.safe_dump(TRAINING), f"train-{i}").json()["id"] for i in range(2)]
            for run_id in training:
                _wait_state(client, run_id, {"running"})

            def one(i: int) -> tuple[int, int, int, int, float]:
                with httpx.Client(base_url=url, timeout=60) as c:
                    started = time.perf_counter()
                    first = _submit(c, SUBMITTED, f"load-{i}")
                    elapsed = time.perf_counter() - started
                    again = _submit(c, SUBMITTED, f"load-{i}")  # the retry of a response that got lost
                    return (first.status_code, again.status_code, first.json().get("id", -1),
                            again.json().get("id", -2), elapsed)

            with ThreadPoolExecutor(CLIENTS) as pool:
                results = list(pool.map(one, range(SUBMISSIONS)))
            still_training = [client.get(f"/api/v1/runs/{r}").json()["state"] for r in training]
            # leave nothing behind on the session's Ray: the queue first (so nothing new starts), then the two
            for _, _, run_id, _, _ in results:
                client.post(f"/api/v1/runs/{run_id}/cancel")
            for run_id in training:
                client.post(f"/api/v1/runs/{run_id}/cancel")
            for run_id in training:
                _wait_state(client, run_id, {"cancelled", "succeeded", "failed"})
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(60)

    assert still_training == ["running", "running"], log.read_text()[-3000:]
    assert [(a, b) for a, b, *_ in results] == [(201, 200)] * SUBMISSIONS  # none failed; the retry found its run
    assert all(first == again for _, _, first, again, _ in results)
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as conn:
            keys = conn.execute(sa.text("SELECT idempotency_key, count(*) FROM runs GROUP BY idempotency_key")).all()
    finally:
        engine.dispose()
    assert len(keys) == SUBMISSIONS + 2 and all(n == 1 for _, n in keys)  # one run per key, no duplicates
    ms = sorted(r[4] * 1000 for r in results)
    p50, p99 = statistics.median(ms), ms[int(0.99 * (len(ms) - 1))]
    print(f"POST /runs under load ({CLIENTS} clients, {SUBMISSIONS} submissions, 2 runs training): "
          f"p50 {p50:.0f} ms, p99 {p99:.0f} ms, max {ms[-1]:.0f} ms")
