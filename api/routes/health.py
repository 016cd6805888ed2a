"""``/healthz`` (the process is up), ``/readyz`` (its dependencies answer) and ``/metrics`` (Prometheus).

Not under ``/api/v1`` and never behind auth: probes and scrapers call them. ``/readyz`` never starts Ray; it
checks Ray only when this process already runs it or an address is configured.
"""

from __future__ import annotations

import socket
import sys
from typing import Any

import sqlalchemy as sa
from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy.orm import Session, sessionmaker

from api.schemas import Health, Readiness
from orchestrator.settings import Settings

router = APIRouter(tags=["health"])


@router.get("/healthz", summary="Liveness: the process answers")
def healthz() -> Health:
    return Health(status="ok")


def _check_db(factory: sessionmaker[Session] | None) -> str:
    if factory is None:
        return "not configured"
    try:
        with factory() as session:
            session.execute(sa.text("SELECT 1"))
    except Exception as exc:  # any failure means "not ready"; the message says which
        return f"error: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return "ok"


def _check_ray(settings: Settings) -> str:
    ray: Any = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:
            ray.cluster_resources()
        except Exception as exc:
            return f"error: {type(exc).__name__}: {exc}"
        return "ok"
    address = settings.ray_address
    if not address or address == "auto":
        return "skipped"
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return f"error: cannot parse ray address {address!r}"
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            pass
    except OSError as exc:
        return f"error: {exc}"
    return "ok"


@router.get(
    "/readyz",
    summary="Readiness: the database (and Ray, when in use) answer",
    responses={503: {"model": Readiness, "description": "A dependency is not reachable."}},
)
def readyz(request: Request) -> Response:
    checks = {
        "database": _check_db(request.app.state.session_factory),
        "ray": _check_ray(request.app.state.settings),
    }
    ok = all(v in ("ok", "skipped") for v in checks.values())
    body = Readiness(status="ok" if ok else "unavailable", checks=checks)
    return JSONResponse(body.model_dump(mode="json"), status_code=200 if ok else 503)


@router.get(
    "/metrics",
    summary="Prometheus metrics",
    response_class=Response,
    responses={
        200: {"description": "Prometheus text format.", "content": {"text/plain": {"schema": {"type": "string"}}}}
    },
)
def metrics(request: Request) -> Response:
    data = generate_latest(request.app.state.metrics.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)
