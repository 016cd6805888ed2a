"""Store rows as the recovery policy and the scheduler read them: one place that turns an ``attempts`` row into an
``AttemptRecord``, a ``checkpoints`` row into a ``CheckpointRecord``, and ``attempts.outcome`` into typed values.

``attempts.outcome`` holds the ``end`` event the workers sent (``contracts.wire.EndEvent``, stored whole) with
the scheduler's verdict on top: ``outcome`` (which may differ from the event's, e.g. ``crashed`` when the worker
group failed after all), ``error`` (one line) and ``error_detail`` (the full text, when shortened). An attempt
that never reported an end (a crash, a start that failed) has the verdict only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from contracts.wire import EndEvent, ProbePlan, finite_or_none
from orchestrator.policy.recovery import ATTEMPT_KINDS, AttemptRecord, CheckpointRecord
from orchestrator.policy.states import TERMINAL_ATTEMPT_STATES, AttemptState
from orchestrator.store.models import Attempt, CheckpointRow, Run

VERDICT = "outcome"
"""The scheduler's verdict in ``attempts.outcome``: succeeded | diverged | crashed | cancelled."""
ERROR = "error"
ERROR_DETAIL = "error_detail"
END_MARK = "final_step"
"""The one key every ``end`` event has (``EndEvent.final_step`` has no default) and the verdict alone lacks."""


def _finite(x: Any) -> float | None:
    """A stored metric as a float the policy can compare (anything else: unknown)."""
    return finite_or_none(float(x)) if isinstance(x, int | float) and not isinstance(x, bool) else None


@dataclass(frozen=True)
class StoredOutcome:
    """``attempts.outcome``, read."""

    verdict: str | None
    """How the attempt ended (None: it has not)."""
    end: EndEvent | None
    """The end event the workers reported, if any."""
    error: str | None

    @classmethod
    def read(cls, raw: Mapping[str, Any] | None) -> StoredOutcome:
        raw = raw or {}
        verdict = raw.get(VERDICT)
        error = raw.get(ERROR)
        return cls(
            verdict=None if verdict is None else str(verdict),
            end=EndEvent.from_dict(raw) if END_MARK in raw else None,
            error=None if error is None else str(error),
        )


def with_verdict(raw: Mapping[str, Any] | None, verdict: str, error: str | None = None,
                 detail: str | None = None) -> dict[str, Any]:
    """``attempts.outcome`` with the scheduler's verdict (and the error, one line and in full) written on top."""
    data = dict(raw or {})
    data[VERDICT] = verdict
    if error is not None:
        data[ERROR] = error
    if detail is not None:
        data[ERROR_DETAIL] = detail
    return data


END_EVENT_DATA = ("final_step", "onset_step", "detector")
"""The ``EndEvent`` fields an attempt's end writes into the audit log: where it ended, and what ended it."""


def end_event_data(attempt: Attempt) -> dict[str, Any]:
    """The audit-log data of an attempt's end (the fields its end event sent; every one from a real worker)."""
    raw = attempt.outcome or {}
    end = StoredOutcome.read(raw).end
    if end is None:
        return {}
    return {k: getattr(end, k) for k in END_EVENT_DATA if k in raw}


def attempt_record(attempt: Attempt, outcome: AttemptState | None = None) -> AttemptRecord:
    """The policy's view of an attempt; ``outcome`` stands in for its state when it ended but is not marked yet."""
    stored = StoredOutcome.read(attempt.outcome)
    end = stored.end
    return AttemptRecord(
        number=attempt.number,
        kind=attempt.kind if attempt.kind in ATTEMPT_KINDS else "initial",
        outcome=(outcome or AttemptState(attempt.state)).value,
        start_step=attempt.resume_step or 0,
        onset_step=attempt.onset_step,
        final_step=end.final_step if end is not None else attempt.last_step,
        detector=end.detector if end is not None else None,
        value=end.value if end is not None else None,
        overrides=dict(attempt.overrides or {}),
        data_offset=int((attempt.plan or {}).get("data_offset") or 0),
        loss_scale_collapsed=end.loss_scale_collapsed if end is not None else False,
        median_grad_norm=end.median_grad_norm if end is not None else None,
        error=stored.error,
        resumed_from_id=attempt.parent_checkpoint_id,
        rewarm_steps=int((attempt.plan or {}).get("rewarm_steps") or 0),
        pending_probe=ProbePlan.from_plan(attempt.plan),
        probe_steps=int(((attempt.plan or {}).get("lr_probe") or {}).get("steps_run") or 0),
    )


def run_history(run: Run, ended: Attempt | None = None, outcome: AttemptState | None = None) -> list[AttemptRecord]:
    """The run's ended attempts, oldest first, as the policy reads them; ``ended`` counts as ended with
    ``outcome`` (it is last: no attempt is newer than the one that just ended)."""
    return [
        attempt_record(a, outcome if a is ended else None)
        for a in run.attempts
        if a is ended or a.state in TERMINAL_ATTEMPT_STATES
    ]


def checkpoint_record(row: CheckpointRow, attempt_number: int) -> CheckpointRecord:
    return CheckpointRecord(
        id=row.id, attempt_number=attempt_number, step=row.step, uri=row.uri, healthy=row.healthy,
        valid=not row.deleted and not (row.verdict or {}).get("corrupt"),
        loss=_finite((row.metrics or {}).get("smoothed_loss")),
    )


def run_checkpoints(session: Session, run: Run) -> list[CheckpointRecord]:
    """Every checkpoint of the run (deleted and corrupt ones as invalid), in write order."""
    rows = session.scalars(sa.select(CheckpointRow).where(CheckpointRow.run_id == run.id).order_by(CheckpointRow.id))
    numbers = {a.id: a.number for a in run.attempts}
    return [checkpoint_record(r, numbers.get(r.attempt_id, 0)) for r in rows]
