"""The web dashboard at ``/``, its static files under ``/static``, and the API docs (``/docs``, ``/redoc``).

Everything a browser loads comes from this server: the dashboard is plain ES modules with a vendored chart
library (``api/static/vendor/SOURCES.md``), and Swagger UI and ReDoc are served from vendored bundles instead of a
CDN, so the docs work with no network. The pages carry a Content-Security-Policy that allows only this origin,
which turns any stray off-site request into a visible browser error rather than a silent dependency.

None of this is behind auth: the files hold no data. The dashboard asks for a token (kept in the tab's session
storage) when the API answers 401, and sends it as ``Authorization: Bearer`` on every call.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse
from starlette.staticfiles import StaticFiles
from starlette.types import Message, Receive, Scope, Send

from orchestrator.settings import Settings

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
STATIC_PREFIX = "/static"
FAVICON = f"{STATIC_PREFIX}/dashboard/favicon.svg"

_SELF_ONLY = "; ".join((
    "default-src 'self'",
    "img-src 'self' data: blob:",
    "style-src 'self' 'unsafe-inline'",  # uPlot and the doc bundles set style attributes
    "script-src 'self'",
    "connect-src 'self'",
    "worker-src 'self' blob:",
    "object-src 'none'",
    "base-uri 'none'",
    "frame-ancestors 'none'",
))
DASHBOARD_CSP = _SELF_ONLY
# FastAPI's docs pages start their bundle with a small inline script
DOCS_CSP = _SELF_ONLY.replace("script-src 'self'", "script-src 'self' 'unsafe-inline'")

router = APIRouter(include_in_schema=False)


def _headers(csp: str) -> dict[str, str]:
    return {"Content-Security-Policy": csp, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


@router.get("/")
def dashboard(request: Request) -> HTMLResponse:
    """The single-page dashboard; its views are hash routes (``/#/runs/12``). The page says whether auth is on,
    so it asks for a token up front instead of provoking a 401 first."""
    settings: Settings = request.app.state.settings
    page = (STATIC_DIR / "dashboard" / "index.html").read_text(encoding="utf-8")
    page = page.replace("{{auth_mode}}", settings.auth_mode.value)
    return HTMLResponse(page, headers=_headers(DASHBOARD_CSP))


@router.get("/docs")
def swagger_ui() -> HTMLResponse:
    page = get_swagger_ui_html(
        openapi_url="/openapi.json",
        title="Ballast API",
        swagger_js_url=f"{STATIC_PREFIX}/vendor/swagger-ui/swagger-ui-bundle.js",
        swagger_css_url=f"{STATIC_PREFIX}/vendor/swagger-ui/swagger-ui.css",
        swagger_favicon_url=FAVICON,
        oauth2_redirect_url=None,
        # validatorUrl: no badge that would ask a public validator about our schema
        swagger_ui_parameters={"validatorUrl": None, "persistAuthorization": False},
    )
    page.headers.update(_headers(DOCS_CSP))
    return page


@router.get("/redoc")
def redoc() -> HTMLResponse:
    page = get_redoc_html(
        openapi_url="/openapi.json",
        title="Ballast API",
        redoc_js_url=f"{STATIC_PREFIX}/vendor/redoc/redoc.standalone.js",
        redoc_favicon_url=FAVICON,
        with_google_fonts=False,
    )
    page.headers.update(_headers(DOCS_CSP))
    return page


class _StaticFiles(StaticFiles):
    """Starlette's static files, revalidated on every load (``no-cache`` + its ETag) so an upgraded server never
    runs against a stale script cached by the browser."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(b"cache-control", b"no-cache"), (b"x-content-type-options", b"nosniff")]
                message = {**message, "headers": headers}
            await send(message)

        await super().__call__(scope, receive, send_with_headers)


def install_dashboard(app: FastAPI) -> None:
    """Mount the dashboard, its static files and the docs pages on ``app`` (created with ``docs_url=None``,
    ``redoc_url=None``)."""
    app.include_router(router)
    app.mount(STATIC_PREFIX, _StaticFiles(directory=STATIC_DIR), name="static")
