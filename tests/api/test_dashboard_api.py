"""The dashboard at ``/``, its static files, the API docs on vendored assets, and ``/runs/{id}/layers``.

Every page must load only from this server: each ``src``/``href`` of the pages is a local path that answers 200,
and no served file names a CDN (the docs must work with no network). The browser tests (``tests/browser``) drive
the same pages in Chromium.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from api.routes.dashboard import STATIC_DIR
from ballast import Client
from orchestrator.store.models import LayerSnapshotRow
from tests.api.conftest import seed_attempt, seed_run

CDN_HOSTS = ("cdn.jsdelivr.net", "unpkg.com", "cdnjs.cloudflare.com", "fonts.googleapis.com", "fonts.gstatic.com",
             "cdn.redoc.ly", "fastapi.tiangolo.com")
DASHBOARD_FILES = ("index.html", "app.js", "api.js", "util.js", "runs.js", "editor.js", "run.js", "charts.js",
                   "heatmap.js", "export.js", "yaml.js", "app.css", "favicon.svg")
VENDORED = ("uplot/uPlot.iife.min.js", "uplot/uPlot.min.css", "uplot/LICENSE",
            "swagger-ui/swagger-ui-bundle.js", "swagger-ui/swagger-ui.css", "swagger-ui/LICENSE", "swagger-ui/NOTICE",
            "redoc/redoc.standalone.js", "redoc/LICENSE", "SOURCES.md")


class _Refs(HTMLParser):
    """Every URL a page makes the browser load: ``src`` of any element, ``href`` of ``<link>``."""

    def __init__(self) -> None:
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value and (name == "src" or (name == "href" and tag == "link")):
                self.urls.append(value)


def _loaded_urls(html: str) -> list[str]:
    parser = _Refs()
    parser.feed(html)
    # FastAPI's Swagger page also names URLs inside its inline script (`url: '/openapi.json'`)
    parser.urls += re.findall(r"""\burl:\s*['"]([^'"]+)['"]""", html)
    parser.urls += re.findall(r"""spec-url=['"]([^'"]+)['"]""", html)
    return parser.urls


def _assert_all_local(client: TestClient, html: str) -> list[str]:
    urls = _loaded_urls(html)
    assert urls, "the page loads nothing?"
    for url in urls:
        assert url.startswith("/") and not url.startswith("//"), f"not a local URL: {url}"
        r = client.get(url)
        assert r.status_code == 200, url
        assert not any(host in r.text for host in CDN_HOSTS), url
    assert not re.search(r"https?://(?!www\.w3\.org)", "".join(_loaded_urls(html)))
    return urls


def test_root_serves_the_dashboard(client: TestClient) -> None:
    r = client.get("/")
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "connect-src 'self'" in csp and "script-src 'self';" in csp
    assert '<meta name="ballast-auth" content="off">' in r.text
    urls = _assert_all_local(client, r.text)
    assert "/static/dashboard/app.js" in urls and "/static/vendor/uplot/uPlot.iife.min.js" in urls
    js = client.get("/static/dashboard/app.js")
    assert js.headers["content-type"].startswith(("text/javascript", "application/javascript"))
    assert js.headers["cache-control"] == "no-cache"


def test_dashboard_says_when_auth_is_on(make_client: Callable[..., TestClient]) -> None:
    c = make_client(auth=True)
    r = c.get("/")  # the page itself holds no data: no token needed to load it
    assert r.status_code == 200
    assert '<meta name="ballast-auth" content="token">' in r.text
    assert c.get("/static/dashboard/run.js").status_code == 200
    assert c.get("/api/v1/runs").status_code == 401  # the data still needs one


@pytest.mark.parametrize("path", ["/docs", "/redoc"])
def test_api_docs_reference_only_local_assets(client: TestClient, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/html")
    assert "content-security-policy" in r.headers
    assert not any(host in r.text for host in CDN_HOSTS)
    assert not re.search(r"""(src|href)=["']https?:""", r.text)
    urls = _assert_all_local(client, r.text)
    assert "/openapi.json" in urls
    expected = "/static/vendor/swagger-ui/swagger-ui-bundle.js" if path == "/docs" \
        else "/static/vendor/redoc/redoc.standalone.js"
    assert expected in urls
    assert '"validatorUrl": null' in r.text or path == "/redoc"


def test_every_shipped_file_is_there_and_names_no_cdn() -> None:
    for name in DASHBOARD_FILES:
        text = (STATIC_DIR / "dashboard" / name).read_text(encoding="utf-8")
        assert not re.search(r"https?://(?!www\.w3\.org/2000/svg)", text), name
    for name in VENDORED:
        path = STATIC_DIR / "vendor" / name
        assert path.is_file() and path.stat().st_size > 0, name
        if name.endswith((".js", ".css", ".html")):
            text = path.read_text(encoding="utf-8")
            assert not any(host in text for host in CDN_HOSTS), name


def test_unknown_static_file_is_a_problem_404(client: TestClient) -> None:
    for path in ("/static/dashboard/nope.js", "/static/../api/app.py", "/static/%2e%2e/api/app.py"):
        r = client.get(path)
        assert r.status_code == 404, path
        assert r.headers["content-type"] == "application/problem+json", path


def test_openapi_lists_the_layers_endpoint_and_no_page_routes(client: TestClient) -> None:
    paths = client.get("/openapi.json").json()["paths"]
    assert "/api/v1/runs/{run_id}/layers" in paths
    assert not {"/", "/docs", "/redoc"} & set(paths)


# ------------------------------------------------------------------------------------------------- layers
def _add_snapshots(factory: sessionmaker[Session], run_id: int, attempt_id: int, steps: list[int]) -> None:
    with factory() as s:
        for step in steps:
            s.add(LayerSnapshotRow(run_id=run_id, attempt_id=attempt_id, step=step,
                                   block_grad_norms=[2.5, "Infinity" if step == 60 else 0.5 / (step + 1)],
                                   layer_grad_norms={"blocks.0.w": 2.5}, update_ratio=0.004,
                                   diagnosis="vanishing with depth" if step >= 40 else None))
        s.commit()


def test_layers_lists_every_snapshot_in_attempt_then_step_order(
    url: str, session_factory: sessionmaker[Session]
) -> None:
    run_id = seed_run(session_factory, state="running")
    a1 = seed_attempt(session_factory, run_id, 1, state="diverged")
    a2 = seed_attempt(session_factory, run_id, 2, state="running", kind="numeric_retry")
    other = seed_run(session_factory, name="other", state="running")
    _add_snapshots(session_factory, run_id, a2, [60, 50])  # attempt 2 re-runs the steps after its checkpoint
    _add_snapshots(session_factory, run_id, a1, [60, 0, 20, 40])
    api = f"{url}/api/v1/runs/{run_id}/layers"
    r = httpx.get(api)
    assert r.status_code == 200
    body = r.json()
    assert [(d["attempt"], d["step"]) for d in body["data"]] == [(1, 0), (1, 20), (1, 40), (1, 60), (2, 50), (2, 60)]
    assert (body["count"], body["next"]) == (6, None)
    assert body["data"][3] == {"attempt": 1, "step": 60, "block_grad_norms": [2.5, "Infinity"],
                               "layer_grad_norms": {"blocks.0.w": 2.5}, "update_ratio": 0.004,
                               "diagnosis": "vanishing with depth"}
    # a live page asks for what it has not seen: one attempt, after a step
    live = httpx.get(api, params={"attempt": 1, "after_step": 20}).json()
    assert [(d["attempt"], d["step"]) for d in live["data"]] == [(1, 40), (1, 60)] and live["count"] == 2
    # pages follow the cursor through the attempt boundary
    seen, cursor = [], None
    while True:
        page = httpx.get(api, params={"limit": 4, **({"cursor": cursor} if cursor else {})}).json()
        seen += [(d["attempt"], d["step"]) for d in page["data"]]
        assert page["count"] == 6
        cursor = page["next"]
        if not cursor:
            break
    assert seen == [(d["attempt"], d["step"]) for d in body["data"]]
    assert httpx.get(f"{url}/api/v1/runs/{other}/layers").json() == {"count": 0, "next": None, "data": []}
    assert httpx.get(f"{url}/api/v1/runs/999999/layers").status_code == 404
    bad = httpx.get(api, params={"cursor": "nope"})
    assert bad.status_code == 422 and bad.headers["content-type"] == "application/problem+json"
    bad = httpx.get(api, params={"attempt": 0})
    assert bad.status_code == 422 and [e["path"] for e in bad.json()["errors"]] == ["query.attempt"]


def test_the_sdk_reads_every_layer_snapshot(url: str, session_factory: sessionmaker[Session]) -> None:
    run_id = seed_run(session_factory, state="running")
    a1 = seed_attempt(session_factory, run_id, 1, state="running")
    _add_snapshots(session_factory, run_id, a1, list(range(0, 1200 * 10, 10)))  # more than one page of 1000
    with Client(url) as client:
        got = client.layers(run_id)
        assert [d["step"] for d in got] == list(range(0, 12000, 10))
        assert [d["step"] for d in client.layers(run_id, attempt=1, after_step=11970)] == [11980, 11990]


def test_layers_of_someone_elses_run_is_404(
    make_server: Callable[..., str], make_token: Callable[..., dict[str, str]],
    session_factory: sessionmaker[Session],
) -> None:
    base = make_server(auth=True)
    run_id = seed_run(session_factory, owner="alice", state="running")
    alice, bob = make_token("alice", "read"), make_token("bob", "read")
    api = f"{base}/api/v1/runs/{run_id}/layers"
    assert httpx.get(api).status_code == 401
    assert httpx.get(api, headers=bob).status_code == 404
    assert httpx.get(api, headers=alice).status_code == 200


def test_the_package_data_ships_the_static_tree() -> None:
    """``pyproject.toml`` must ship the nested static folders (a plain ``static/*`` misses them)."""
    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    patterns = pyproject["tool"]["setuptools"]["package-data"]["api"]
    api_dir = STATIC_DIR.parent
    matched = {p for pattern in patterns for p in api_dir.glob(pattern) if p.is_file()}
    for name in DASHBOARD_FILES:
        assert STATIC_DIR / "dashboard" / name in matched, name
    for name in VENDORED:
        assert STATIC_DIR / "vendor" / name in matched, name
