"""One real ``ballast serve`` (SQLite, local Ray) in a temporary BALLAST_HOME, and the REST calls the benchmark
makes. Everything goes through ``/api/v1`` as a user's client would; nothing reads the store directly."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
# the embedded defaults whatever this shell configured (a benchmark must not use someone's cluster or database)
_CLEARED = ("BALLAST_DATABASE_URL", "BALLAST_CHECKPOINT_ROOT", "BALLAST_RAY_ADDRESS", "RAY_ADDRESS",
            "BALLAST_AUTH_MODE", "BALLAST_TOKEN", "BALLAST_URL")


def _ballast_cmd() -> list[str]:
    exe = Path(sys.executable).with_name("ballast")
    return [str(exe)] if exe.exists() else [sys.executable, "-c", "from api.cli import main; main()"]


class Service:
    """``with Service(home) as svc:`` starts ``ballast serve`` and stops it (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, home: Path, *, num_cpus: int = 2, max_concurrent: int = 2, start_timeout_s: float = 240.0,
                 log: Path | None = None) -> None:
        self.home = home
        self.port = free_port()  # below the ephemeral range: nothing takes it before serve binds it
        self.url = f"http://127.0.0.1:{self.port}"
        self.num_cpus = num_cpus
        self.max_concurrent = max_concurrent
        self.start_timeout_s = start_timeout_s
        self.log_path = log or home / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.client = httpx.Client(base_url=self.url + "/api/v1", timeout=60.0)

    def __enter__(self) -> Service:
        self.home.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in _CLEARED}
        env.update({
            "BALLAST_HOME": str(self.home),
            "BALLAST_RAY_NUM_CPUS": str(self.num_cpus),
            "BALLAST_MAX_CONCURRENT_RUNS": str(self.max_concurrent),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
        })
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in __exit__
        self.proc = subprocess.Popen([*_ballast_cmd(), "serve", "--port", str(self.port), "--log-level", "warning"],
                                     cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.monotonic() + self.start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"ballast serve exited ({self.proc.returncode}); log:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2.0).status_code == 200:
                    self.get("/runs", params={"limit": 1})
                    return self
            except (httpx.HTTPError, RuntimeError):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ballast serve did not answer in {self.start_timeout_s:.0f} s; log:\n"
                                   f"{self.log_tail()}")
            time.sleep(1.0)

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        self.client.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
        if getattr(self, "_log", None) is not None:
            self._log.close()

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    # ------------------------------------------------------------------------------------------- REST
    def get(self, path: str, **kw: Any) -> Any:
        resp = self.client.get(path, **kw)
        if resp.status_code != 200:
            raise RuntimeError(f"GET {path}: {resp.status_code} {resp.text[:500]}")
        return resp.json()

    def submit(self, recipe: dict[str, Any]) -> int:
        resp = self.client.post("/runs", json=recipe, headers={"Idempotency-Key": str(uuid.uuid4())})
        if resp.status_code not in (200, 201):
            raise RuntimeError(f"POST /runs ({recipe.get('name')}): {resp.status_code} {resp.text[:1000]}")
        return int(resp.json()["id"])

    def wait(self, run_ids: list[int], *, timeout_s: float, poll_s: float = 5.0,
             progress: Any = None) -> dict[int, dict[str, Any]]:
        """Poll until every run is terminal or ``timeout_s`` passes (then the rest are cancelled).

        One paged ``GET /runs?state=…`` per poll for the finished ones (not one request per run: on two shared
        cores, per-run polling of ~100 runs would take a visible share of the CPU the runs need)."""
        wanted = set(run_ids)
        done: dict[int, dict[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while True:
            cursor: str | None = None
            while True:
                params: list[tuple[str, Any]] = [("limit", 200), *(("state", s) for s in sorted(TERMINAL))]
                if cursor:
                    params.append(("cursor", cursor))
                page = self.get("/runs", params=params)
                for run in page["data"]:
                    if run["id"] in wanted and run["id"] not in done:
                        done[run["id"]] = run
                        if progress is not None:
                            progress(run, len(done), len(run_ids))
                cursor = page.get("next")
                if not cursor:
                    break
            if len(done) == len(wanted):
                return done
            if time.monotonic() > deadline:
                for rid in wanted - done.keys():
                    self.client.post(f"/runs/{rid}/cancel")
                raise TimeoutError(f"{len(wanted) - len(done)} run(s) not finished after {timeout_s:.0f} s: "
                                   f"{sorted(wanted - done.keys())}")
            time.sleep(poll_s)

    def collect(self, run_id: int, *, max_steps: int) -> dict[str, Any]:
        """Run, attempts, all anomalies (every page) and the loss, lr, grad-norm, loss-scale and skipped-step series
        with nothing downsampled."""
        run = self.get(f"/runs/{run_id}")
        attempts = self.get(f"/runs/{run_id}/attempts")["data"]
        anomalies: list[dict[str, Any]] = []
        cursor: str | None = None
        while True:
            params: dict[str, Any] = {"limit": 1000}
            if cursor:
                params["cursor"] = cursor
            page = self.get(f"/runs/{run_id}/anomalies", params=params)
            anomalies.extend(page["data"])
            cursor = page.get("next")
            if not cursor:
                break
        # every attempt re-runs at most max_steps steps: ask for more points than can exist, so none is dropped
        max_points = min(10_000, max(2, 2 * max_steps * max(1, len(attempts))))
        metrics = self.get(f"/runs/{run_id}/metrics",
                           params={"series": ["loss", "lr", "grad_norm", "loss_scale", "skipped"],
                                   "max_points": max_points})
        out_series: dict[str, Any] = {}
        for s in metrics["series"]:
            if s["downsampled"]:
                raise RuntimeError(f"run {run_id}: series {s['name']} was downsampled ({s['total_points']} points)")
            out_series[s["name"]] = {"steps": s["steps"], "values": s["values"], "attempts": s["attempts"]}
        return {"run": run, "attempts": attempts, "anomalies": anomalies, "series": out_series}


def remove_home(home: Path) -> None:
    shutil.rmtree(home, ignore_errors=True)
