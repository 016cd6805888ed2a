"""One router per resource, collected here: ``api_router`` (under ``/api/v1``) and ``health_router`` (root)."""

from __future__ import annotations

from fastapi import APIRouter

from api.routes import anomalies, attempts, checkpoints, events, health, metrics, recipes, runs, tokens

API_PREFIX = "/api/v1"

api_router = APIRouter(prefix=API_PREFIX)
for _module in (recipes, runs, attempts, anomalies, checkpoints, metrics, events, tokens):
    api_router.include_router(_module.router)

health_router = health.router

__all__ = ["API_PREFIX", "api_router", "health_router"]
