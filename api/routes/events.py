"""``/runs/{run_id}/events``: a live Server-Sent Events stream of a run.

The stream polls the store (every ~0.5 s) and sends, in this order per poll: ``state`` (new rows of the audit
log: run and attempt transitions with their reasons), ``anomaly`` (new anomalies) and ``metric`` (the newest
per-step metrics only: a watcher wants the current loss, not every step). It opens with a ``run`` snapshot
and ends with an ``end`` snapshot once the run is finished. Each message's ``id`` is the stream position
``<event id>.<anomaly id>.<metric id>``; a reconnecting client sends it back as ``Last-Event-ID`` and
continues where it stopped. The framing (``text/event-stream``, no-cache headers, a ``: ping`` comment after 15 s
without a message) is FastAPI's ``EventSourceResponse``; this module only decides what to send.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated

import anyio
import sqlalchemy as sa
from fastapi import APIRouter, Header, Query, Request
from fastapi.sse import EventSourceResponse, ServerSentEvent
from pydantic import BaseModel
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from api.auth import ReadableRun
from api.errors import problem_responses
from api.schemas import StateEvent
from api.serialize import anomaly_read, metric_event, run_read
from orchestrator.policy.states import TERMINAL_RUN_STATES, RunState
from orchestrator.store import repo
from orchestrator.store.models import AnomalyRow, Attempt, Event, MetricPoint, Run

router = APIRouter(tags=["events"])

BATCH = 500
RETRY_MS = 2000
"""How long a disconnected client waits before it reconnects (the stream's opening ``retry`` field)."""


@dataclass
class _Position:
    event: int = 0
    anomaly: int = 0
    metric: int = 0

    @classmethod
    def parse(cls, raw: str | None) -> _Position:
        """``a.b.c`` → position; anything else starts from the beginning (a stale or foreign id is harmless)."""
        parts = (raw or "").strip().split(".")
        if len(parts) != 3 or not all(p.isdigit() and len(p) <= 18 for p in parts):
            return cls()
        return cls(*(int(p) for p in parts))

    def __str__(self) -> str:
        return f"{self.event}.{self.anomaly}.{self.metric}"


@dataclass
class _Batch:
    messages: list[ServerSentEvent] = field(default_factory=list)
    finished: bool = False
    more: bool = False


def _message(kind: str, pos: _Position, payload: BaseModel) -> ServerSentEvent:
    return ServerSentEvent(event=kind, id=str(pos), data=payload)


def _snapshot(session: Session, run: Run) -> BaseModel:
    ids = [run.id]
    return run_read(run, repo.anomaly_counts(session=session, run_ids=ids)[run.id],
                    repo.current_overrides(session=session, run_ids=ids)[run.id])


def _poll(factory: sessionmaker[Session], run_id: int, pos: _Position, first: bool) -> _Batch:
    """One look at the store: what is new since ``pos`` (advanced in place), and whether the run is over."""
    out = _Batch()
    with factory() as session:
        run = session.get(Run, run_id)
        if run is None:  # deleted under us
            out.finished = True
            return out
        # read the state first: rows committed with (or before) a final state are then visible below
        finished = RunState(run.state) in TERMINAL_RUN_STATES
        if first:
            out.messages.append(_message("run", pos, _snapshot(session, run)))
        events = session.scalars(
            sa.select(Event).where(Event.run_id == run_id, Event.id > pos.event).order_by(Event.id).limit(BATCH)
        ).all()
        for ev in events:
            pos.event = ev.id
            out.messages.append(_message("state", pos, StateEvent.model_validate(ev)))
        anomalies = session.execute(
            sa.select(AnomalyRow, Attempt.number)
            .join(Attempt, Attempt.id == AnomalyRow.attempt_id)
            .where(AnomalyRow.run_id == run_id, AnomalyRow.id > pos.anomaly)
            .order_by(AnomalyRow.id)
            .limit(BATCH)
        ).all()
        for an, number in anomalies:
            pos.anomaly = an.id
            out.messages.append(_message("anomaly", pos, anomaly_read(an, number)))
        latest = session.execute(
            sa.select(MetricPoint, Attempt.number)
            .join(Attempt, Attempt.id == MetricPoint.attempt_id)
            .where(MetricPoint.run_id == run_id, MetricPoint.id > pos.metric)
            .order_by(MetricPoint.id.desc())
            .limit(1)
        ).first()
        if latest is not None:
            mp, number = latest
            pos.metric = mp.id
            out.messages.append(_message("metric", pos, metric_event(mp, number)))
        out.more = len(events) == BATCH or len(anomalies) == BATCH
        if finished and not out.more:
            out.finished = True
            out.messages.append(_message("end", pos, _snapshot(session, run)))
    return out


@router.get(
    "/runs/{run_id}/events",
    summary="Live event stream of a run (Server-Sent Events)",
    description=__doc__,
    response_class=EventSourceResponse,
    responses={
        200: {
            "description": "`text/event-stream` with events `run`, `state`, `anomaly`, `metric`, `end`; each "
            "`data` is JSON (RunRead, StateEvent, AnomalyRead, MetricEvent, RunRead).",
            "content": {"text/event-stream": {"schema": {"type": "string"}}},
        },
        **problem_responses(401, 403, 404, 422),
    },
)
async def stream_events(
    run: ReadableRun,
    request: Request,
    last_event_id: Annotated[
        str | None, Header(alias="Last-Event-ID", max_length=64, description="Resume after this position.")
    ] = None,
    follow: Annotated[
        bool, Query(description="Keep streaming until the run finishes; false: send what is there and end.")
    ] = True,
) -> AsyncIterator[ServerSentEvent]:
    factory: sessionmaker[Session] = request.app.state.session_factory
    interval: float = request.app.state.event_poll_seconds
    run_id = run.id
    pos = _Position.parse(last_event_id)
    yield ServerSentEvent(retry=RETRY_MS)
    first = True
    while True:
        batch = await run_in_threadpool(_poll, factory, run_id, pos, first)
        first = False
        for msg in batch.messages:
            yield msg
        if batch.finished or (not follow and not batch.more):
            return
        if not batch.more:
            await anyio.sleep(interval)
