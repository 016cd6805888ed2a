"""The store's own rules on both backends: manual retry resumes where the recovery policy's lineage says, rows read
as the policy's records, the rules' hops applied with the audit log, and what the live event stream polls."""

from __future__ import annotations

from typing import Any

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session, sessionmaker

from contracts.recipe import validate_recipe_data
from contracts.wire import ProbePlan
from orchestrator.policy.rules import Happening, Note, Resolution, Situation, Why, resolve
from orchestrator.policy.states import AttemptState, RunState
from orchestrator.store.db import transaction
from orchestrator.store.models import AnomalyRow, Attempt, CheckpointRow, Event, MetricPoint, Run
from orchestrator.store.queries import anomalies_after, newest_metric_after, state_changes_after
from orchestrator.store.records import StoredOutcome, attempt_record, end_event_data, with_verdict
from orchestrator.store.repo import apply_transitions, create_run, request_cancel, request_retry


def _run(factory: sessionmaker[Session], state: str = "failed") -> int:
    recipe = validate_recipe_data({"name": "store-test", "optimizer": {"lr": 0.003}})
    with transaction(factory) as s:
        run, _ = create_run(session=s, owner="alice", recipe=recipe, text="name: store-test\n")
        run.state = state
        return run.id


def _attempt(factory: sessionmaker[Session], run_id: int, number: int, **kw: Any) -> int:
    kw.setdefault("state", "diverged")
    with transaction(factory) as s:
        att = Attempt(run_id=run_id, number=number, kind=kw.pop("kind", "initial"), **kw)
        s.add(att)
        run = s.get(Run, run_id)
        assert run is not None
        run.current_attempt = number
        s.flush()
        return att.id


def _checkpoint(factory: sessionmaker[Session], run_id: int, attempt_id: int, step: int, *, healthy: bool = True,
                verdict: dict[str, Any] | None = None) -> int:
    with transaction(factory) as s:
        row = CheckpointRow(run_id=run_id, attempt_id=attempt_id, step=step, uri=f"file:///c/{attempt_id}/{step}",
                            sha256="a" * 64, healthy=healthy, verdict=verdict or {})
        s.add(row)
        s.flush()
        return row.id


def _retry(factory: sessionmaker[Session], run_id: int) -> Attempt:
    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        att = request_retry(session=s, run=run, by="alice")
        s.flush()
        s.expunge(att)
        return att


# ------------------------------------------------------------------------------------------- manual retry
def test_manual_retry_resumes_on_the_lineage_not_on_an_abandoned_branch(session_factory: sessionmaker[Session]) -> None:
    run_id = _run(session_factory)
    a1 = _attempt(session_factory, run_id, 1)
    c20 = _checkpoint(session_factory, run_id, a1, 20)
    _checkpoint(session_factory, run_id, a1, 40)  # on attempt 1's branch after the point attempt 2 went back to
    a2 = _attempt(session_factory, run_id, 2, kind="numeric_retry", resume_step=20, parent_checkpoint_id=c20)
    c30 = _checkpoint(session_factory, run_id, a2, 30)
    _checkpoint(session_factory, run_id, a2, 35, healthy=False)
    att = _retry(session_factory, run_id)
    assert (att.number, att.kind, att.parent_checkpoint_id, att.resume_step) == (3, "manual", c30, 30)
    assert att.plan["resume_uri"] == f"file:///c/{a2}/30"


def test_manual_retry_skips_a_checkpoint_found_corrupt(session_factory: sessionmaker[Session]) -> None:
    run_id = _run(session_factory)
    a1 = _attempt(session_factory, run_id, 1, state="crashed")
    c10 = _checkpoint(session_factory, run_id, a1, 10)
    _checkpoint(session_factory, run_id, a1, 20, verdict={"corrupt": "sha256 mismatch"})
    att = _retry(session_factory, run_id)
    assert (att.parent_checkpoint_id, att.resume_step) == (c10, 10)


def test_manual_retry_without_an_ended_attempt_starts_fresh(session_factory: sessionmaker[Session]) -> None:
    run_id = _run(session_factory, state="cancelled")
    att = _retry(session_factory, run_id)
    assert (att.number, att.parent_checkpoint_id, att.resume_step) == (1, None, 0)
    assert att.plan == {"rewarm_steps": 0, "data_offset": 0, "resume_uri": None}


def test_cancelling_a_queued_run_follows_the_rules(session_factory: sessionmaker[Session]) -> None:
    run_id = _run(session_factory, state="failed")
    _retry(session_factory, run_id)
    with transaction(session_factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        request_cancel(session=s, run=run, by="bob")
        got = [(e.entity, e.from_state, e.to_state, e.reason) for e in
               s.scalars(sa.select(Event).where(Event.run_id == run_id).order_by(Event.id))]
    assert got[-3:] == [("run", "failed", "queued", "manual retry by alice"),
                        ("attempt", "pending", "cancelled", "cancelled by bob"),
                        ("run", "queued", "cancelled", "cancelled by bob")]


# ------------------------------------------------------------------------------------------------ records
def test_a_stored_outcome_with_an_end_event_and_the_verdict_on_top() -> None:
    end = {"outcome": "diverged", "final_step": 30, "onset_step": 25, "detector": "loss_spike", "value": 9.5,
           "reason": "spike", "median_grad_norm": 1.5, "loss_scale_collapsed": True, "extra": "kept"}
    raw = with_verdict(end, "crashed", "RuntimeError: boom", "Traceback ...\nRuntimeError: boom")
    assert raw["extra"] == "kept" and raw["error_detail"].startswith("Traceback")
    stored = StoredOutcome.read(raw)
    assert (stored.verdict, stored.error) == ("crashed", "RuntimeError: boom")
    assert stored.end is not None and (stored.end.final_step, stored.end.onset_step) == (30, 25)
    att = Attempt(number=2, kind="numeric_retry", state="crashed", resume_step=10, onset_step=25, last_step=31,
                  overrides={"optimizer.lr": [0.1, 0.05]}, plan={"data_offset": 3}, outcome=raw,
                  parent_checkpoint_id=7)
    rec = attempt_record(att)
    assert (rec.number, rec.kind, rec.outcome, rec.start_step, rec.onset_step, rec.final_step) == (
        2, "numeric_retry", "crashed", 10, 25, 30)
    assert (rec.detector, rec.value, rec.median_grad_norm, rec.loss_scale_collapsed) == ("loss_spike", 9.5, 1.5, True)
    assert (rec.data_offset, rec.error, rec.resumed_from_id) == (3, "RuntimeError: boom", 7)
    assert (rec.rewarm_steps, rec.pending_probe) == (0, None)
    assert end_event_data(att) == {"final_step": 30, "onset_step": 25, "detector": "loss_spike"}
    probe = {"candidates": [0.05, 0.0125], "steps": 10}
    att.plan = {"rewarm_steps": 20, "lr_probe": probe}  # the probe had not chosen when the attempt ended
    rec = attempt_record(att)
    assert (rec.rewarm_steps, rec.pending_probe) == (20, ProbePlan(candidates=(0.05, 0.0125), steps=10))
    assert (rec.probe_steps, rec.steps_executed) == (0, 20)  # steps 10 → 30, no probe result yet
    att.plan = {"rewarm_steps": 20, "lr_probe": {**probe, "chosen": 0.0125, "steps_run": 17}}
    rec = attempt_record(att)
    assert rec.pending_probe is None
    assert (rec.probe_steps, rec.steps_executed) == (17, 37)  # the step budget charges the probe's steps too


def test_a_verdict_without_an_end_event() -> None:
    att = Attempt(number=1, kind="weird", state="running", resume_step=0, last_step=12,
                  outcome=with_verdict(None, "crashed", "lost"))
    assert StoredOutcome.read(att.outcome).end is None
    with pytest.raises(ValueError):
        attempt_record(att)  # still running: not an outcome the policy knows
    rec = attempt_record(att, AttemptState.crashed)  # ended now, not marked yet
    assert (rec.kind, rec.outcome, rec.final_step, rec.detector, rec.error) == ("initial", "crashed", 12, None, "lost")
    assert end_event_data(att) == {}


# ----------------------------------------------------------------------------------------------- transitions
def test_apply_transitions_checks_the_next_attempt(session_factory: sessionmaker[Session]) -> None:
    run_id = _run(session_factory, state="failed")
    retry = resolve(Situation(Happening.RETRY_REQUESTED, run=_state(session_factory, run_id)))
    with transaction(session_factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        with pytest.raises(ValueError, match="without that attempt"):
            apply_transitions(session=s, resolution=retry, run=run, notes={Why.EVENT: Note("x")})
        running = Attempt(run_id=run_id, number=1, state="running", kind="manual")
        with pytest.raises(ValueError, match="not pending"):
            apply_transitions(session=s, resolution=retry, run=run, next_attempt=running, notes={Why.EVENT: Note("x")})
        apply_transitions(session=s, resolution=Resolution(rules=(), hops=()), run=run, notes={})
        assert run.state == "failed"


def _state(factory: sessionmaker[Session], run_id: int) -> RunState:
    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        return RunState(run.state)


# ------------------------------------------------------------------------------------- the live stream's polls
def test_what_the_live_stream_polls(session_factory: sessionmaker[Session]) -> None:
    run_id = _run(session_factory, state="running")
    a1 = _attempt(session_factory, run_id, 1, state="running")
    with transaction(session_factory) as s:
        s.add_all([MetricPoint(run_id=run_id, attempt_id=a1, step=i, loss=2.0 - i / 10) for i in range(3)])
        s.add_all([AnomalyRow(run_id=run_id, attempt_id=a1, seq=i, step=i, kind="loss_spike", detector="loss_spike",
                              action="record") for i in (1, 2)])
    with transaction(session_factory) as s:
        events = state_changes_after(session=s, run_id=run_id, after=0, limit=10)
        assert [e.to_state for e in events] == ["queued"]  # the submission
        assert state_changes_after(session=s, run_id=run_id, after=events[-1].id, limit=10) == []
        anomalies = anomalies_after(session=s, run_id=run_id, after=0, limit=1)
        assert [(a.seq, n) for a, n in anomalies] == [(1, 1)]
        assert [(a.seq, n) for a, n in anomalies_after(session=s, run_id=run_id, after=anomalies[0][0].id,
                                                         limit=10)] == [(2, 1)]
        newest = newest_metric_after(session=s, run_id=run_id, after=0)
        assert newest is not None and (newest[0].step, newest[1]) == (2, 1)
        assert newest_metric_after(session=s, run_id=run_id, after=newest[0].id) is None


@pytest.mark.parametrize(("metrics", "loss"), [({"loss": 2.0, "smoothed_loss": 1.5}, 1.5), ({"loss": 2.0}, None),
                                               ({"smoothed_loss": None}, None), ({"smoothed_loss": "x"}, None),
                                               ({"smoothed_loss": True}, None), (None, None)])
def test_checkpoint_record_reads_the_smoothed_loss_the_rollback_compares(
    metrics: dict[str, object] | None, loss: float | None
) -> None:
    from orchestrator.store.models import CheckpointRow
    from orchestrator.store.records import checkpoint_record

    row = CheckpointRow(id=7, step=50, uri="file:///c/50", healthy=True, deleted=False, verdict={}, metrics=metrics)
    assert checkpoint_record(row, 1).loss == loss
