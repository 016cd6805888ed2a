"""CPU per ``GET /api/v1/runs/{id}`` (or, with ``--post``, per ``POST /api/v1/runs`` of a JSON recipe) with no HTTP
server and no load generator: the app driven in-process through its ASGI interface (token auth on, PostgreSQL),
``--in-flight`` requests at once, so that a change to the route's own path shows without uvicorn's and the client's
share of 2 shared cores. ``--profile`` prints a cProfile of the event loop's thread (CPU time; the database work
runs in worker threads and shows only as their hand-offs).

Usage: ``python benchmarks/profile_get_run.py [--post] [--requests N] [--in-flight N] [--profile]``; set
``BALLAST_BENCH_TREE=<tree>`` (and ``PYTHONPATH``) to measure another checkout of the code, e.g. one exported with
``git archive``, from the same venv. Needs the tests' PostgreSQL (``BALLAST_TEST_PG_URL``).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pstats
import sys
import time
from pathlib import Path
from typing import Any

TREE = Path(os.environ.get("BALLAST_BENCH_TREE") or Path(__file__).resolve().parents[1])
sys.path.insert(0, str(TREE))

from bench_api import PEPPER, RECIPE, prepare  # noqa: E402  (benchmarks/bench_api.py)
from pg import pg_database  # noqa: E402


async def drive(app: Any, token: str, run_id: int | None, total: int, concurrency: int) -> None:
    """``total`` GETs of run ``run_id``, or POSTs of ``RECIPE`` when it is None, ``concurrency`` at a time."""
    method, path, body = ("GET", f"/api/v1/runs/{run_id}", b"") if run_id else ("POST", "/api/v1/runs",
                                                                                 json.dumps(RECIPE).encode())
    headers = [(b"host", b"bench"), (b"authorization", f"Bearer {token}".encode())]
    if body:
        headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    expected = 200 if method == "GET" else 201

    async def one() -> None:
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "query_string": b"", "root_path": "", "headers": headers,
            "server": ("127.0.0.1", 80), "client": ("127.0.0.1", 1),
        }
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        await app(scope, receive, send)
        if sent[0]["status"] != expected:
            raise RuntimeError(f"{method} {path}: {sent}")

    left = total

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await one()

    await asyncio.gather(*(client() for _ in range(concurrency)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--post", action="store_true", help="POST /runs (a JSON recipe) instead of GET /runs/{id}")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--in-flight", type=int, default=8, help="requests at once")
    ap.add_argument("--profile", action="store_true", help="print a cProfile of the event loop's thread")
    args = ap.parse_args()
    with pg_database() as url:
        token, run_id = prepare(url)
        os.environ.update({"BALLAST_DATABASE_URL": url, "BALLAST_AUTH_MODE": "token", "BALLAST_TOKEN_PEPPER": PEPPER})
        from api.app import create_app
        from orchestrator.settings import Settings

        app = create_app(Settings())

        async def run() -> None:
            async with app.router.lifespan_context(app):
                target = None if args.post else run_id
                await drive(app, token, target, 300, args.in_flight)  # warm-up: pool, statements, token cache
                profiler = cProfile.Profile(time.process_time) if args.profile else None
                cpu = time.process_time()
                if profiler is not None:
                    profiler.enable()
                await drive(app, token, target, args.requests, args.in_flight)
                if profiler is not None:
                    profiler.disable()
                cpu = time.process_time() - cpu
                what = "POST" if args.post else "GET"
                print(f"{TREE}: {cpu / args.requests * 1000:.3f} ms CPU per {what} ({args.requests} requests, "
                      f"{args.in_flight} in flight)")
                if profiler is not None:
                    pstats.Stats(profiler).sort_stats("cumulative").print_stats(40)

        asyncio.run(run())


if __name__ == "__main__":
    main()
