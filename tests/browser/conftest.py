"""Browser-test fixtures: a real ``ballast serve`` (SQLite + local Ray under a temp BALLAST_HOME) per auth mode,
and headless Chromium driven by Playwright.

The browser is Debian's ``chromium`` (``.ci/run`` installs it); Playwright's own browser download is never used
(the machine has no network). Without chromium these tests skip, except in CI (``CI=true``), where they fail.
Each server is module-scoped and parametrised by auth mode, so a module starts one server per mode (the
machine has two cores).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.ports import free_port

CHROMIUM = os.environ.get("BALLAST_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
VIEWPORT = {"width": 1280, "height": 800}
START_TIMEOUT_S = 180.0
REPO = Path(__file__).resolve().parents[2]


def _unavailable(reason: str) -> None:
    """Skip locally; in CI a missing browser is a broken setup, so fail."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (CI must have it: .ci/run installs chromium, `make setup` installs playwright)")
    pytest.skip(reason)


def wait_for(condition: Callable[[], Any], *, timeout: float, what: str, every: float = 0.25) -> Any:
    """Poll ``condition`` until it returns something truthy; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


@dataclass
class Server:
    """A running ``ballast serve``: its URL, the token to use (auth on) and a REST client that sends it."""

    url: str
    auth: bool
    token: str | None
    home: Path
    log: Path
    process: subprocess.Popen[bytes]
    client: httpx.Client = field(init=False)

    def __post_init__(self) -> None:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self.client = httpx.Client(base_url=self.url + "/api/v1", headers=headers, timeout=30.0)

    def get(self, path: str, **params: Any) -> Any:
        r = self.client.get(path, params=params)
        r.raise_for_status()
        return r.json()

    def wait_terminal(self, run_id: int, timeout: float = 400.0) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            self.check_alive()
            run: dict[str, Any] = self.get(f"/runs/{run_id}")
            return run if run["state"] in ("succeeded", "failed", "cancelled") else None

        result: dict[str, Any] = wait_for(done, timeout=timeout, what=f"run {run_id} to finish", every=0.5)
        return result

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            pytest.fail(f"ballast serve exited ({self.process.returncode}); its log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _server_env(home: Path, auth: bool, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BALLAST_", "RAY_ADDRESS"))}
    env.update({
        "BALLAST_HOME": str(home),
        "BALLAST_RAY_NUM_CPUS": "2",
        "BALLAST_AUTH_MODE": "token" if auth else "off",
        "BALLAST_BIND_HOST": "127.0.0.1",
        "BALLAST_BIND_PORT": str(port),
        "PYTHONUNBUFFERED": "1",
    })
    return env


def _ballast() -> str:
    exe = Path(sys.executable).with_name("ballast")
    return str(exe) if exe.exists() else (shutil.which("ballast") or "ballast")


def _create_token(env: dict[str, str]) -> str:
    """Migrate the server's database and create a read+submit token in it, as an operator would."""
    subprocess.run([_ballast(), "db", "upgrade"], env=env, check=True, capture_output=True, timeout=120)
    out = subprocess.run(
        [_ballast(), "token", "create", "--name", "t", "--scope", "read", "--scope", "submit", "--json"],
        env=env, check=True, capture_output=True, timeout=120, text=True,
    )
    token = json.loads(out.stdout)["token"]
    assert isinstance(token, str) and token
    return token


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="module", params=["auth-off", "auth-on"])
def server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    auth = request.param == "auth-on"
    home = tmp_path_factory.mktemp(f"ballast-{request.param}")
    port = free_port()
    env = _server_env(home, auth, port)
    token = _create_token(env) if auth else None
    log = home / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [_ballast(), "serve", "--port", str(port), "--log-level", "warning"],
            env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(home), start_new_session=True,
        )
    srv = Server(url=f"http://127.0.0.1:{port}", auth=auth, token=token, home=home, log=log, process=proc)
    try:
        def up() -> bool:
            srv.check_alive()
            try:
                return httpx.get(f"{srv.url}/healthz", timeout=2.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(up, timeout=START_TIMEOUT_S, what=f"ballast serve on port {port}", every=0.5)
        yield srv
    finally:
        srv.client.close()
        _stop(proc)


# ---------------------------------------------------------------------------------------------------- browser
@pytest.fixture(scope="session")
def playwright() -> Iterator[Any]:
    if not (os.path.isfile(CHROMIUM) and os.access(CHROMIUM, os.X_OK)):
        _unavailable(f"chromium is not installed at {CHROMIUM} (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _unavailable("playwright is not installed (pip install -e '.[dev]')")
    pw = sync_playwright().start()
    try:
        yield pw
    finally:
        pw.stop()


@pytest.fixture(scope="module")
def context(playwright: Any, server: Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A Chromium with a fresh profile for this server; pages opened in it share nothing but cookies."""
    profile = tmp_path_factory.mktemp("chromium-profile")
    ctx = playwright.chromium.launch_persistent_context(
        str(profile), executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS, viewport=VIEWPORT,
        service_workers="block",
    )
    ctx.set_default_timeout(30_000)
    try:
        yield ctx
    finally:
        ctx.close()


class Watched:
    """A page with everything that went wrong on it: console errors, page errors, off-origin requests."""

    def __init__(self, page: Any, origin: str) -> None:
        self.page = page
        self.console_errors: list[str] = []
        self.page_errors: list[str] = []
        self.foreign_requests: list[str] = []
        page.on("console", lambda m: self.console_errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: self.page_errors.append(str(e)))

        def on_request(req: Any) -> None:
            if not req.url.startswith((origin + "/", "data:", "blob:")):
                self.foreign_requests.append(req.url)

        page.on("request", on_request)

    def problems(self) -> dict[str, list[str]]:
        return {k: v for k, v in {"console errors": self.console_errors, "page errors": self.page_errors,
                                  "off-origin requests": self.foreign_requests}.items() if v}


@pytest.fixture
def open_page(context: Any, server: Server) -> Iterator[Callable[..., Watched]]:
    """``open_page(path)`` → a Watched page at ``server.url + path``, signed in when auth is on."""
    pages: list[Any] = []

    def open_(path: str = "/", *, sign_in: bool = True) -> Watched:
        page = context.new_page()
        pages.append(page)
        watched = Watched(page, server.url)
        page.goto(server.url + path)
        if server.auth and sign_in:
            sign_in_with_token(page, server.token or "")
        return watched

    yield open_
    for p in pages:
        p.close()


def sign_in_with_token(page: Any, token: str) -> None:
    page.wait_for_selector("#token-form")
    page.fill("#token-input", token)
    page.click("#token-form button[type=submit]")
    page.wait_for_selector("#token-form", state="detached")
