"""REST API throughput and latency against PostgreSQL, side by side with a bare FastAPI endpoint.

Two uvicorn servers run as subprocesses, one after the other, on the same machine and with the same uvicorn
settings (workers, event loop, HTTP parser): the Ballast app (token auth on, PostgreSQL store) and a bare FastAPI
app whose endpoints do no I/O (the floor the framework and server set). For each, ``--concurrency`` keep-alive
connections send a bounded number of requests back to back:

* ``GET /api/v1/runs/{id}``: token check (cached), then the run with its recipe, newest attempt and anomaly counts
  (one statement); bare: ``GET /bare/{id}`` returning a small model.
* ``POST /api/v1/runs``: parse and validate a JSON recipe, insert recipe, run and event, commit; bare:
  ``POST /bare`` parsing the same JSON body into a dict.

The load generator is a minimal asyncio HTTP/1.1 client (pre-built request bytes, Content-Length responses) so
that it takes as little of the shared CPU as possible; it still runs on the same cores as the server and
PostgreSQL, so the numbers are a lower bound for a server with the machine to itself. Besides req/s and latency,
each row has the CPU time per request of the server processes, of the PostgreSQL backends serving the benchmark
database and of the load generator: steadier than req/s on a shared machine, and together they say how many
requests a second the machine's cores can carry at all.

With ``--before-commit C`` the app as it was at commit ``C`` (exported with ``git archive`` and served from the same
venv and database) is measured too, in the same run, between the bare endpoint and this tree's app; ``--rounds N``
repeats the whole sequence, interleaved.

Usage: ``python benchmarks/bench_api.py [--get N] [--post N] [--concurrency C] [--workers W] [--loop L] [--http H]
[--before-commit C] [--rounds N] [--json]``. ``--loop``/``--http`` default to uvicorn's ``auto`` (uvloop and
httptools, installed with ``uvicorn[standard]``, as ``ballast serve`` uses them); ``--loop asyncio --http h11``
gives the pure-Python stack.
Needs the PostgreSQL server of the tests (``BALLAST_TEST_PG_URL``, default ``postgres@127.0.0.1:5432``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
TREE = Path(os.environ.get("BALLAST_BENCH_TREE") or REPO)
"""The tree whose app is served (``--before-commit`` serves an exported older tree beside this one)."""
sys.path.insert(0, str(TREE))

import sqlalchemy as sa  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from pg import pg_database  # noqa: E402  (benchmarks/pg.py)
from pydantic import BaseModel  # noqa: E402

PEPPER = "bench-pepper"
RECIPE: dict[str, Any] = {
    "apiVersion": "ballast/v1",
    "kind": "StabilityRecipe",
    "name": "bench",
    "model": {"name": "tiny_gpt", "n_layers": 2, "d_model": 64},
    "data": {"name": "markov", "vocab_size": 64},
    "training": {"max_steps": 200, "batch_size": 16},
    "optimizer": {"name": "adamw", "lr": 0.003},
}


# ------------------------------------------------------------------------------------------- the two apps
def ballast_app() -> FastAPI:
    """uvicorn factory: the real app, configured from the environment (BALLAST_DATABASE_URL, token auth)."""
    from api.app import create_app
    from orchestrator.settings import Settings

    return create_app(Settings())


class _Item(BaseModel):
    id: int
    name: str
    state: str


def bare_app() -> FastAPI:
    """uvicorn factory: FastAPI with two endpoints that do no I/O, both sync like the Ballast routes."""
    app = FastAPI()

    @app.get("/bare/{item_id}")
    def get_item(item_id: int) -> _Item:
        return _Item(id=item_id, name="bench", state="queued")

    @app.post("/bare", status_code=201)
    def post_item(body: dict[str, Any]) -> _Item:
        return _Item(id=1, name=str(body.get("name")), state="queued")

    return app


# --------------------------------------------------------------------------------------------- the database


def prepare(url: str) -> tuple[str, int]:
    """Migrate, issue an admin token and submit one run to read back; returns (token, run id)."""
    import migrations
    from api.auth import issue_token
    from contracts.recipe import validate_recipe_data
    from orchestrator.store import repo
    from orchestrator.store.db import make_engine, make_session_factory, transaction

    migrations.upgrade(url)
    engine = make_engine(url)
    with transaction(make_session_factory(engine)) as s:
        _, token = issue_token(session=s, pepper=PEPPER, name="bench", principal="bench", scopes=["read", "submit"])
        run, _ = repo.create_run(session=s, owner="bench", recipe=validate_recipe_data(RECIPE), text=json.dumps(RECIPE))
        run_id = run.id
    engine.dispose()
    return token, run_id


# ------------------------------------------------------------------------------------------------- servers
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of these processes, from /proc (0 for one that is gone or unreadable)."""
    total = 0.0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def process_cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process and its children (uvicorn's workers)."""
    pids = [pid]
    try:
        children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
        pids += [int(p) for p in children.split()]
    except OSError:
        pass
    return cpu_seconds(pids)


def backend_pids(url: str) -> list[int]:
    """PIDs of the PostgreSQL backends connected to the benchmark database (the server's pooled connections)."""
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ))
            return [int(r[0]) for r in rows]
    finally:
        engine.dispose()


@contextmanager
def uvicorn(factory: str, env: dict[str, str], workers: int, loop: str, http: str,
            tree: Path = REPO) -> Iterator[tuple[int, int]]:
    port = free_port()
    cmd = [sys.executable, "-m", "uvicorn", "--factory", factory, "--app-dir", str(REPO / "benchmarks"),
           "--host", "127.0.0.1", "--port", str(port), "--workers", str(workers), "--no-access-log",
           "--log-level", "warning", "--loop", loop, "--http", http]
    proc = subprocess.Popen(cmd, cwd=tree, env={**os.environ, **env, "PYTHONPATH": str(tree),
                                                "BALLAST_BENCH_TREE": str(tree)})
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"uvicorn {factory} did not start") from None
                time.sleep(0.1)
        yield port, proc.pid
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------------------- load generator
def request_bytes(method: str, path: str, headers: dict[str, str], body: bytes = b"") -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return status


@dataclass
class Result:
    requests: int
    seconds: float
    latencies: list[float]
    statuses: dict[int, int]
    server_cpu: float = 0.0
    db_cpu: float | None = None
    """None: no database, or its backends changed during the run (connections opened and closed, so their CPU
    cannot be summed)."""
    client_cpu: float = 0.0

    @property
    def cpu_ms(self) -> float:
        """Server CPU per request: steadier than req/s on a machine shared with other work."""
        return self.server_cpu / self.requests * 1000

    @property
    def db_cpu_ms(self) -> float | None:
        return None if self.db_cpu is None else self.db_cpu / self.requests * 1000

    @property
    def client_cpu_ms(self) -> float:
        return self.client_cpu / self.requests * 1000

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000


async def load(port: int, payload: bytes, total: int, concurrency: int) -> Result:
    latencies: list[float] = []
    statuses: dict[int, int] = {}
    remaining = total

    async def client() -> None:
        nonlocal remaining
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            while remaining > 0:
                remaining -= 1
                t0 = time.perf_counter()
                writer.write(payload)
                status = await _read_response(reader)
                latencies.append(time.perf_counter() - t0)
                statuses[status] = statuses.get(status, 0) + 1
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return Result(total, time.perf_counter() - start, latencies, statuses)


def measure(server: tuple[int, int], payload: bytes, total: int, concurrency: int, db_url: str | None = None) -> Result:
    port, pid = server
    asyncio.run(load(port, payload, min(total, 200), concurrency))  # warm-up: pool, caches, imports
    backends = backend_pids(db_url) if db_url else []
    cpu0, db0, client0 = process_cpu_seconds(pid), cpu_seconds(backends), time.process_time()
    result = asyncio.run(load(port, payload, total, concurrency))
    result.client_cpu = time.process_time() - client0
    result.server_cpu = process_cpu_seconds(pid) - cpu0
    if db_url and sorted(backend_pids(db_url)) == sorted(backends):
        result.db_cpu = cpu_seconds(backends) - db0
    return result


def server_stack(loop: str, http: str) -> str:
    """What uvicorn's ``auto`` resolves to here (the servers run in this interpreter's environment)."""
    import importlib.util

    if loop == "auto":
        loop = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") else "h11"
    return f"{loop} + {http}"


# ------------------------------------------------------------------------------------------------------ main
def export_tree(commit: str, into: Path) -> Path:
    """The repository's files at ``commit`` in ``into`` (``git archive``)."""
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into


def run_targets(url: str, args: argparse.Namespace, before: Path | None) -> list[tuple[str, Result]]:
    token, run_id = prepare(url)
    auth = {"Authorization": f"Bearer {token}"}
    json_headers = {"Content-Type": "application/json"}
    body = json.dumps(RECIPE).encode()
    env = {"BALLAST_DATABASE_URL": url, "BALLAST_AUTH_MODE": "token", "BALLAST_TOKEN_PEPPER": PEPPER}
    get = request_bytes("GET", f"/api/v1/runs/{run_id}", auth)
    post = request_bytes("POST", "/api/v1/runs", {**auth, **json_headers}, body)
    out: list[tuple[str, Result]] = []
    for _ in range(args.rounds):
        with uvicorn("bench_api:bare_app", {}, args.workers, args.loop, args.http) as server:
            out.append(("bare GET", measure(server, request_bytes("GET", f"/bare/{run_id}", {}), args.get,
                                            args.concurrency)))
            out.append(("bare POST", measure(server, request_bytes("POST", "/bare", json_headers, body), args.post,
                                             args.concurrency)))
        trees = ([("before", before)] if before is not None else []) + [("ballast", REPO)]
        for name, tree in trees:
            with uvicorn("bench_api:ballast_app", env, args.workers, args.loop, args.http, tree) as server:
                out.append((f"{name} GET", measure(server, get, args.get, args.concurrency, url)))
                out.append((f"{name} POST", measure(server, post, args.post, args.concurrency, url)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--get", type=int, default=5000, help="GET requests per target")
    ap.add_argument("--post", type=int, default=2000, help="POST requests per target")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--workers", type=int, default=1, help="uvicorn worker processes")
    ap.add_argument("--loop", default="auto", choices=["auto", "asyncio", "uvloop"], help="uvicorn event loop")
    ap.add_argument("--http", default="auto", choices=["auto", "h11", "httptools"], help="uvicorn HTTP parser")
    ap.add_argument("--before-commit", default=None, help="also serve the app as it was at this commit")
    ap.add_argument("--rounds", type=int, default=1, help="repeat the whole sequence this many times")
    ap.add_argument("--json", action="store_true", help="print raw results as JSON")
    args = ap.parse_args()

    rows: list[dict[str, Any]] = []
    with pg_database("ballast_bench") as url, tempfile.TemporaryDirectory(prefix="bench-api-before-") as tmp:
        before = export_tree(args.before_commit, Path(tmp)) if args.before_commit else None
        measured = run_targets(url, args, before)
    for name, r in measured:
        rows.append({"target": name, "requests": r.requests, "rps": round(r.rps, 1), "p50_ms": round(r.pct(0.5), 2),
                     "p99_ms": round(r.pct(0.99), 2), "mean_ms": round(statistics.fmean(r.latencies) * 1000, 2),
                     "server_cpu_ms": round(r.cpu_ms, 3),
                     "db_cpu_ms": None if r.db_cpu_ms is None else round(r.db_cpu_ms, 3),
                     "client_cpu_ms": round(r.client_cpu_ms, 3), "statuses": r.statuses})
    stack = server_stack(args.loop, args.http)
    if args.json:
        print(json.dumps({"concurrency": args.concurrency, "workers": args.workers, "stack": stack, "results": rows},
                         indent=2))
        return
    print(f"{args.concurrency} concurrent keep-alive connections, uvicorn --workers {args.workers} ({stack}), "
          f"PostgreSQL\n")
    print("| round | app | endpoint | req/s | p50 / p99 (ms) | CPU/req: server + PostgreSQL + client | bare FastAPI "
          "req/s | p50 / p99 (ms) | CPU/req: server + client | app / bare req/s | app / bare p99 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    per_round = len(measured) // args.rounds
    for k in range(args.rounds):
        results = dict(measured[k * per_round:(k + 1) * per_round])
        apps = [a for a in ("before", "ballast") if f"{a} GET" in results]
        for app in apps:
            for verb, path in (("GET", "GET /api/v1/runs/{id}"), ("POST", "POST /api/v1/runs")):
                b, x = results[f"{app} {verb}"], results[f"bare {verb}"]
                db = "n/a" if b.db_cpu_ms is None else f"{b.db_cpu_ms:.2f}"
                print(f"| {k + 1} | {'this tree' if app == 'ballast' else args.before_commit} | `{path}` | "
                      f"{b.rps:,.0f} | {b.pct(0.5):.1f} / {b.pct(0.99):.1f} | "
                      f"{b.cpu_ms:.2f} + {db} + {b.client_cpu_ms:.2f} ms | {x.rps:,.0f} | "
                      f"{x.pct(0.5):.1f} / {x.pct(0.99):.1f} | {x.cpu_ms:.2f} + {x.client_cpu_ms:.2f} ms | "
                      f"{b.rps / x.rps:.2f} | {b.pct(0.99) / x.pct(0.99):.2f} |")
    if any(r.db_cpu is None for name, r in measured if not name.startswith("bare")):
        print("\nn/a: the server opened and closed database connections during the run (a churning pool), so the "
              "PostgreSQL backends' CPU could not be summed.")
    bad = {k: r.statuses for k, r in measured if set(r.statuses) - {200, 201}}
    if bad:
        print(f"\nunexpected statuses: {bad}")


if __name__ == "__main__":
    main()
