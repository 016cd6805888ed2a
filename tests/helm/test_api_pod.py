"""The API pod and the migration Job as the chart renders them, run here: their exact commands and environment,
with the Secrets filled in (a SQLite file stands in for PostgreSQL) and a TCP listener standing in for the Ray
head Service. This is what the chart's settings must get right for `ballast serve` to start outside local mode.

The server binds 127.0.0.2: a loopback address (nothing leaves this machine), but not one that `ballast serve`
counts as local, so its outside-local-mode checks (token auth, a real pepper) apply as they do in the pod.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helm.conftest import CHART, Rendered, container, env_of
from tests.ports import free_port

HOST = "127.0.0.2"
BALLAST = str(Path(sysconfig.get_path("scripts")) / "ballast")
PEPPER = "test-pepper-0123456789abcdef"


def pod_env(c: dict[str, Any], secrets: dict[tuple[str, str], str], overrides: dict[str, str]) -> dict[str, str]:
    """A container's environment as the kubelet would give it, with ``secrets[(name, key)]`` for each
    secretKeyRef; then ``overrides`` (paths and addresses of this machine)."""
    env = {"PATH": str(Path(BALLAST).parent) + os.pathsep + "/usr/bin:/bin"}
    for name, entry in env_of(c).items():
        if "value" in entry:
            env[name] = str(entry["value"])
        else:
            ref = entry["valueFrom"]["secretKeyRef"]
            env[name] = secrets[(ref["name"], ref["key"])]
    env.update(overrides)
    return env


def _command(c: dict[str, Any]) -> list[str]:
    argv = list(c["command"]) + list(c.get("args") or [])
    assert argv[0] == "ballast"
    return [BALLAST, *argv[1:]]


@dataclass
class ApiPod:
    url: str
    env: dict[str, str]
    ray_head: socket.socket
    proc: subprocess.Popen[str]


@pytest.fixture(scope="module")
def api_pod(default_render: Rendered, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiPod]:
    tmp = tmp_path_factory.mktemp("api-pod")
    secrets = {("ballast-database", "url"): f"sqlite:///{tmp / 'ballast.db'}", ("ballast-auth", "pepper"): PEPPER}
    ray_head = socket.create_server((HOST, 0))  # accepts TCP connections like the head Service's client port
    port = free_port(HOST)
    overrides = {
        "HOME": str(tmp),
        "BALLAST_HOME": str(tmp / "home"),  # the pod's emptyDir
        "BALLAST_BIND_HOST": HOST,
        "BALLAST_BIND_PORT": str(port),
        "RAY_ADDRESS": f"ray://{HOST}:{ray_head.getsockname()[1]}",
    }

    job = container(default_render.job())
    migrated = subprocess.run(_command(job), env=pod_env(job, secrets, overrides), capture_output=True, text=True,
                              timeout=120)
    assert migrated.returncode == 0, migrated.stderr

    api = container(default_render.deployment("api"))
    env = pod_env(api, secrets, overrides)
    proc = subprocess.Popen(_command(api), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, f"the API exited {proc.returncode}: {proc.stdout.read() if proc.stdout else ''}"
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the API did not answer /healthz within 180 s"
            time.sleep(0.2)
        yield ApiPod(url=url, env=env, ray_head=ray_head, proc=proc)
    finally:
        proc.send_signal(signal.SIGTERM)  # what the kubelet sends first
        try:
            rc = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
            rc = None
        ray_head.close()
    assert rc == 0, f"`ballast serve` ended with {rc} on SIGTERM"


def test_readiness_checks_the_database_and_the_ray_address(api_pod: ApiPod) -> None:
    r = httpx.get(api_pod.url + "/readyz", timeout=10)
    assert r.status_code == 200, r.text
    assert r.json()["checks"] == {"database": "ok", "ray": "ok"}


def test_api_requires_a_token(api_pod: ApiPod) -> None:
    r = httpx.get(api_pod.url + "/api/v1/runs", timeout=10)
    assert r.status_code == 401


def test_admin_token_made_in_the_pod_works_from_the_cli(api_pod: ApiPod) -> None:
    """docs/deploy.md's bootstrap: `ballast token create` with the API pod's environment (kubectl exec), then
    the CLI with --url and --token."""
    made = subprocess.run([BALLAST, "token", "create", "--name", "admin", "--scope", "admin", "--json"],
                          env=api_pod.env, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    token = json.loads(made.stdout)["token"]
    r = httpx.get(api_pod.url + "/api/v1/runs", headers={"Authorization": f"Bearer {token}"}, timeout=10)
    assert r.status_code == 200, r.text
    client_env = {"PATH": api_pod.env["PATH"], "HOME": api_pod.env["HOME"]}
    listed = subprocess.run([BALLAST, "runs", "list", "--url", api_pod.url, "--token", token, "--json"],
                            env=client_env, capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout) is not None
    wrong = httpx.get(api_pod.url + "/api/v1/runs", headers={"Authorization": "Bearer blst_wrong"}, timeout=10)
    assert wrong.status_code == 401


def _series_names(text: str) -> set[str]:
    """The series names a scrape can hold, from the exposition's ``# TYPE`` lines (a family is declared even
    while it has no samples, e.g. anomaly counts on an empty database) and its samples."""
    suffixes = {"counter": ["_total"], "histogram": ["_bucket", "_sum", "_count"], "gauge": [""]}
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for family, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, flags=re.M):
        names |= {family.removesuffix("_total") + s for s in suffixes.get(kind, [""])}
    return names


def test_dashboard_queries_only_series_the_api_exports(api_pod: ApiPod) -> None:
    httpx.get(api_pod.url + "/healthz", timeout=10)  # at least one observation in the latency histogram
    r = httpx.get(api_pod.url + "/metrics", timeout=10)
    assert r.status_code == 200
    exported = _series_names(r.text)
    dashboard = json.loads((CHART / "dashboards" / "ballast.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    queried = {name for e in exprs for name in re.findall(r"\bballast_[a-z_]+", e)}
    assert {"ballast_runs", "ballast_anomalies_total", "ballast_http_request_duration_seconds_bucket"} <= queried
    assert queried <= exported, f"not exported: {sorted(queried - exported)}"
    variables = [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    assert all(set(re.findall(r"\bballast_[a-z_]+", v)) <= exported for v in variables)


def test_readiness_fails_while_ray_is_unreachable(api_pod: ApiPod) -> None:
    """Last in this module: it closes the stand-in head Service."""
    api_pod.ray_head.close()
    r = httpx.get(api_pod.url + "/readyz", timeout=10)
    assert r.status_code == 503
    assert r.json()["checks"]["database"] == "ok"
    assert r.json()["checks"]["ray"].startswith("error")
