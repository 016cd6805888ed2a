"""Prometheus metrics of one app: request latency from a middleware, run/attempt/anomaly counts from the store.

Each app has its own ``CollectorRegistry`` (tests build many apps in one process; the global registry would
refuse the second). Store-derived numbers are read at scrape time with one grouped query each, so they are
exact whichever process (API, scheduler) wrote the rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import sqlalchemy as sa
from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from orchestrator.policy.states import AttemptState, RunState
from orchestrator.store.models import AnomalyRow, Attempt, Run
from orchestrator.store.repo import RECOVERY_KINDS

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class StoreCollector(Collector):
    """Runs by state, attempts by state, anomalies by kind and recoveries by kind, read from the database."""

    def __init__(self, factory: Callable[[], sessionmaker[Session] | None]) -> None:
        self._factory = factory

    def collect(self) -> Iterator[Metric]:
        factory = self._factory()
        if factory is None:
            return
        runs = GaugeMetricFamily("ballast_runs", "Runs by state.", labels=["state"])
        attempts = GaugeMetricFamily("ballast_attempts", "Attempts by state.", labels=["state"])
        anomalies = CounterMetricFamily("ballast_anomalies", "Anomalies detected, by kind.", labels=["kind"])
        recoveries = CounterMetricFamily(
            "ballast_recoveries", "Attempts started to recover a run, by kind.", labels=["kind"]
        )
        with factory() as session:
            by_state = dict(session.execute(sa.select(Run.state, sa.func.count()).group_by(Run.state)).all())
            att_state = dict(
                session.execute(sa.select(Attempt.state, sa.func.count()).group_by(Attempt.state)).all()
            )
            att_kind = dict(session.execute(sa.select(Attempt.kind, sa.func.count()).group_by(Attempt.kind)).all())
            kinds = session.execute(sa.select(AnomalyRow.kind, sa.func.count()).group_by(AnomalyRow.kind)).all()
        for state in RunState:
            runs.add_metric([state.value], float(by_state.get(state.value, 0)))
        for astate in AttemptState:
            attempts.add_metric([astate.value], float(att_state.get(astate.value, 0)))
        for kind, n in sorted(kinds):
            anomalies.add_metric([kind], float(n))
        for rkind in RECOVERY_KINDS:
            recoveries.add_metric([rkind], float(att_kind.get(rkind, 0)))
        yield from (runs, attempts, anomalies, recoveries)


class AppMetrics:
    """The registry of one app and the request-latency histogram its middleware feeds."""

    def __init__(self, factory: Callable[[], sessionmaker[Session] | None]) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram(
            "ballast_http_request_duration_seconds",
            "Time from request to response start, by method, route template and status.",
            ["method", "route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(StoreCollector(factory))


class LatencyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware: it would buffer the event stream). Labels use the route template, so
    ``/api/v1/runs/17`` and ``/api/v1/runs/18`` are one series; unmatched paths share ``<unmatched>``."""

    def __init__(self, app: ASGIApp, metrics: AppMetrics, prefix: str = "") -> None:
        self.app = app
        self.metrics = metrics
        self.prefix = prefix

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        observed = False

        def observe(status: int) -> None:
            nonlocal observed
            if observed:
                return
            observed = True
            route = getattr(scope.get("route"), "path", None) or "<unmatched>"
            # routes of included routers carry their path relative to the router's prefix
            if route.startswith("/") and not scope["path"].startswith(route.split("{", 1)[0]):
                route = self.prefix + route
            self.metrics.latency.labels(scope["method"], route, str(status)).observe(time.perf_counter() - start)

        async def send_timed(message: Message) -> None:
            if message["type"] == "http.response.start":
                observe(int(message["status"]))
            await send(message)

        try:
            await self.app(scope, receive, send_timed)
        finally:
            observe(500)
