"""Event ingestion on both backends: every event type lands where it belongs, a redelivered or reordered batch
changes nothing, long runs are downsampled without losing the steps that matter, and NaN/Inf survive the trip.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given
from hypothesis import settings as hyp_settings
from hypothesis import strategies as st
from sqlalchemy.orm import Session, sessionmaker

from contracts.recipe import validate_recipe_data
from orchestrator.store.db import transaction
from orchestrator.store.ingest import ingest_events, ingest_many
from orchestrator.store.models import AnomalyRow, Attempt, CheckpointRow, EvalPoint, LayerSnapshotRow, MetricPoint, Run
from orchestrator.store.repo import create_run, metric_series
from tests.orchestrator import ingest_before


def _make_run(factory: sessionmaker[Session]) -> tuple[int, int]:
    recipe = validate_recipe_data({"name": "ingest-test"})
    with transaction(factory) as s:
        run, _ = create_run(session=s, owner="alice", recipe=recipe, text="name: ingest-test\n")
        attempt = Attempt(run_id=run.id, number=1, state="running", kind="initial")
        s.add(attempt)
        run.current_attempt = 1
        s.flush()
        return run.id, attempt.id


def _events(spec: list[tuple[str, dict[str, Any]]], start_seq: int = 1) -> list[dict[str, Any]]:
    return [{"attempt": 1, "seq": start_seq + i, "type": t, "data": d} for i, (t, d) in enumerate(spec)]


def _metric(step: int, loss: float, **kw: Any) -> tuple[str, dict[str, Any]]:
    data = {"step": step, "loss": loss, "grad_norm": 1.0, "grad_norm_clipped": 1.0, "lr": 1e-3,
            "loss_scale": None, "throughput": 100.0, "skipped": False}
    data.update(kw)
    return "metric", data


def _ingest(factory: sessionmaker[Session], run_id: int, attempt_id: int, events: list[dict[str, Any]],
            every: int = 1) -> Any:
    with transaction(factory) as s:
        run, attempt = s.get(Run, run_id), s.get(Attempt, attempt_id)
        assert run is not None and attempt is not None
        return ingest_events(session=s, run=run, attempt=attempt, events=events, metrics_every_steps=every)


def _count(factory: sessionmaker[Session], model: type) -> int:
    with transaction(factory) as s:
        return int(s.scalar(sa.select(sa.func.count()).select_from(model)) or 0)


BATCH = [
    _metric(0, 3.0),
    _metric(1, 2.5),
    ("layer_stats", {"step": 1, "layer_grad_norms": {"block0": 0.5, "block1": 0.25}, "update_ratio": 1e-3,
                     "diagnosis": None}),
    _metric(2, 2.0),
    ("checkpoint", {"step": 2, "uri": "/ckpt/step_00000002", "sha256": "a" * 64, "healthy": True,
                    "verdict": {"weights_finite": True, "anomalies_since_previous": 0, "loss_in_bounds": True},
                    "metrics": {"loss": 2.0}}),
    _metric(3, 40.0),
    ("anomaly", {"step": 3, "rank": 0, "kind": "loss_spike", "detector": "loss_spike", "value": 40.0,
                 "threshold": 6.0, "action": "rollback", "details": {"z": 12.5}}),
    ("end", {"outcome": "diverged", "final_step": 3, "onset_step": 3, "detector": "loss_spike", "value": 40.0,
             "reason": "loss spike", "median_grad_norm": 1.0, "loss_scale_collapsed": False}),
]


def test_every_event_type_lands_in_its_table(session_factory: sessionmaker[Session]) -> None:
    run_id, attempt_id = _make_run(session_factory)
    result = _ingest(session_factory, run_id, attempt_id, _events(BATCH))
    assert (result.metrics, result.anomalies, result.checkpoints) == (4, 1, 1)
    assert result.end is not None and result.end["outcome"] == "diverged"
    with transaction(session_factory) as s:
        steps = s.scalars(sa.select(MetricPoint.step).order_by(MetricPoint.step)).all()
        assert steps == [0, 1, 2, 3]
        anomaly = s.scalars(sa.select(AnomalyRow)).one()
        assert (anomaly.seq, anomaly.step, anomaly.kind, anomaly.action, anomaly.value, anomaly.threshold) == (
            7, 3, "loss_spike", "rollback", 40.0, 6.0)
        assert anomaly.details == {"z": 12.5}
        ckpt = s.scalars(sa.select(CheckpointRow)).one()
        assert (ckpt.step, ckpt.uri, ckpt.healthy, ckpt.verdict["weights_finite"]) == (
            2, "/ckpt/step_00000002", True, True)
        attempt, run = s.get(Attempt, attempt_id), s.get(Run, run_id)
        assert attempt is not None and run is not None
        assert attempt.last_seq == 8 and attempt.last_step == 3 and attempt.onset_step == 3
        assert attempt.outcome is not None and attempt.outcome["detector"] == "loss_spike"
        layers = s.scalars(sa.select(LayerSnapshotRow)).one()
        assert (layers.step, layers.layer_grad_norms, layers.block_grad_norms, layers.update_ratio) == (
            1, {"block0": 0.5, "block1": 0.25}, [], 1e-3)
        assert "layer_stats" not in attempt.ray_info  # the table is the one place for them
        assert run.best_loss == 2.0 and run.last_step == 3
        # ingestion records; state changes are the scheduler's
        assert attempt.state == "running" and run.state == "queued"


def test_redelivered_and_reordered_batches_change_nothing(session_factory: sessionmaker[Session]) -> None:
    run_id, attempt_id = _make_run(session_factory)
    events = _events(BATCH)
    _ingest(session_factory, run_id, attempt_id, events[:5])
    # the next delivery overlaps the first (a scheduler died before committing) and arrives reversed
    again = _ingest(session_factory, run_id, attempt_id, list(reversed(events[2:])))
    assert (again.metrics, again.anomalies, again.checkpoints) == (1, 1, 0)  # only what was new: step 3
    replay = _ingest(session_factory, run_id, attempt_id, events)
    assert (replay.metrics, replay.anomalies, replay.checkpoints) == (0, 0, 0)
    assert _count(session_factory, MetricPoint) == 4
    assert _count(session_factory, AnomalyRow) == 1
    assert _count(session_factory, CheckpointRow) == 1
    with transaction(session_factory) as s:
        attempt, run = s.get(Attempt, attempt_id), s.get(Run, run_id)
        assert attempt is not None and run is not None
        assert attempt.last_seq == 8 and run.best_loss == 2.0


def _layer_stats(step: int, blocks: list[float | None]) -> tuple[str, dict[str, Any]]:
    return "layer_stats", {"step": step, "layer_grad_norms": {f"blocks.{i}.w": v for i, v in enumerate(blocks)},
                           "block_grad_norms": blocks, "update_ratio": 2e-3,
                           "diagnosis": "vanishing with depth" if step >= 20 else None}


def test_every_layer_snapshot_is_kept_once(session_factory: sessionmaker[Session]) -> None:
    """The heat map's history: one row per (attempt, step), a replay or a reordered delivery adds nothing, and
    non-finite norms survive as the JSON strings the API sends."""
    run_id, attempt_id = _make_run(session_factory)
    events = _events([_layer_stats(0, [1.0, 0.5]), _metric(0, 3.0), _layer_stats(10, [0.8, 1e-4]),
                      _layer_stats(20, [math.inf, math.nan])])
    first = _ingest(session_factory, run_id, attempt_id, events[:2])
    again = _ingest(session_factory, run_id, attempt_id, list(reversed(events)))
    replay = _ingest(session_factory, run_id, attempt_id, events)
    assert (first.layers, again.layers, replay.layers) == (1, 2, 0)
    with transaction(session_factory) as s:
        rows = s.scalars(sa.select(LayerSnapshotRow).order_by(LayerSnapshotRow.step)).all()
        assert [(r.step, r.block_grad_norms, r.diagnosis) for r in rows] == [
            (0, [1.0, 0.5], None), (10, [0.8, 1e-4], None), (20, ["Infinity", "NaN"], "vanishing with depth")]
        assert rows[2].layer_grad_norms == {"blocks.0.w": "Infinity", "blocks.1.w": "NaN"}
        assert all(r.run_id == run_id and r.update_ratio == 2e-3 for r in rows)


def test_long_runs_are_downsampled_but_keep_the_steps_that_matter(session_factory: sessionmaker[Session]) -> None:
    run_id, attempt_id = _make_run(session_factory)
    spec = [_metric(step, 2.0 - step / 100) for step in range(23)]
    spec[7] = _metric(7, 1.9, skipped=True)
    spec[11] = _metric(11, float("nan"))
    spec.append(("anomaly", {"step": 13, "rank": 0, "kind": "grad_norm_spike", "detector": "grad_norm_spike",
                             "value": 99.0, "threshold": 6.0, "action": "skip_step", "details": {}}))
    spec.append(("end", {"outcome": "succeeded", "final_step": 22, "onset_step": None}))
    _ingest(session_factory, run_id, attempt_id, _events(spec), every=5)
    with transaction(session_factory) as s:
        steps = s.scalars(sa.select(MetricPoint.step).order_by(MetricPoint.step)).all()
        run = s.get(Run, run_id)
        assert run is not None
        # multiples of 5, the skipped step, the NaN step, the anomaly's step and the final step
        assert steps == [0, 5, 7, 10, 11, 13, 15, 20, 22]
        # every metric counts for the aggregates, stored or not (the best finite, non-skipped loss: step 22)
        assert run.best_loss == pytest.approx(2.0 - 22 / 100)
        assert run.last_step == 22


def test_non_finite_numbers_are_stored_safely(session_factory: sessionmaker[Session]) -> None:
    run_id, attempt_id = _make_run(session_factory)
    events = _events([
        _metric(0, float("nan"), grad_norm=float("inf")),
        ("anomaly", {"step": 0, "rank": 0, "kind": "nonfinite", "detector": "nonfinite", "value": float("inf"),
                     "threshold": None, "action": "rollback", "details": {"loss": float("nan")}}),
        ("end", {"outcome": "diverged", "final_step": 0, "onset_step": 0, "value": float("nan")}),
    ])
    _ingest(session_factory, run_id, attempt_id, events)
    with transaction(session_factory) as s:
        point = s.scalars(sa.select(MetricPoint)).one()
        anomaly = s.scalars(sa.select(AnomalyRow)).one()
        attempt, run = s.get(Attempt, attempt_id), s.get(Run, run_id)
        assert attempt is not None and run is not None
        assert point.loss is None and point.grad_norm is None
        assert anomaly.value is None and anomaly.details == {"loss": "NaN", "value": "Infinity"}
        assert attempt.outcome is not None and attempt.outcome["value"] == "NaN"
        assert run.best_loss is None


def test_a_bad_downsampling_factor_is_refused(session_factory: sessionmaker[Session]) -> None:
    run_id, attempt_id = _make_run(session_factory)
    with pytest.raises(ValueError, match="metrics_every_steps"):
        _ingest(session_factory, run_id, attempt_id, _events([_metric(0, 1.0)]), every=0)


# ------------------------------------------------------------------------------------------------ eval points
def _eval(step: int, loss: float | None) -> tuple[str, dict[str, Any]]:
    return "eval", {"step": step, "eval_loss": loss, "batches": 4}


def test_eval_events_land_in_eval_points_idempotently_and_never_downsampled(
    session_factory: sessionmaker[Session],
) -> None:
    run_id, attempt_id = _make_run(session_factory)
    spec = [_eval(0, 3.4)] + [_metric(step, 3.0 - step / 100) for step in range(23)]
    spec[8:8] = [_eval(7, 2.9)]
    spec += [_eval(14, 2.7), _eval(21, float("nan")), _eval(23, 2.6),
             ("end", {"outcome": "succeeded", "final_step": 23, "onset_step": None})]
    events = _events(spec)
    first = _ingest(session_factory, run_id, attempt_id, events[:20], every=5)
    assert first.evals == 2
    again = _ingest(session_factory, run_id, attempt_id, list(reversed(events)), every=5)
    assert again.evals == 3  # only the new ones
    assert _ingest(session_factory, run_id, attempt_id, events, every=5).evals == 0
    with transaction(session_factory) as s:
        rows = s.execute(sa.select(EvalPoint.step, EvalPoint.eval_loss).order_by(EvalPoint.step)).all()
        assert [tuple(r) for r in rows] == [(0, 3.4), (7, 2.9), (14, 2.7), (21, None), (23, 2.6)]
        (series,) = metric_series(session=s, run_id=run_id, series=["eval_loss"])
        assert series.steps == [0, 7, 14, 23] and series.values == [3.4, 2.9, 2.7, 2.6]  # NULL left out
        assert series.attempts == [1, 1, 1, 1] and series.total == 4
        run, attempt = s.get(Run, run_id), s.get(Attempt, attempt_id)
        assert run is not None and attempt is not None
        assert run.best_loss == pytest.approx(2.78)  # the training loss's aggregate only
        assert attempt.last_step == 23


PROBED = {"start_step": 50, "steps": 10, "steps_run": 16, "chosen": 2.5e-4,
          "reason": "lr probe from step 50: 0.001 → divergence at step 55; 0.00025 → loss 1.2; chose 0.00025",
          "candidates": [{"lr": 1e-3, "score": None, "failed": "divergence at step 55", "steps": 6},
                         {"lr": 2.5e-4, "score": 1.2, "failed": None, "steps": 10}]}


@pytest.mark.parametrize("via", ["event", "end", "both"])
def test_an_lr_probe_sets_the_attempts_lr_once(session_factory: sessionmaker[Session], via: str) -> None:
    """What the probe chose becomes the attempt's LR override (the next retry tightens from it), its plan keeps the
    result and its reason says so: from the ``lr_probe`` event, or from the ``end`` event that carries it again
    when the end is ingested first; a redelivery changes nothing."""
    run_id, attempt_id = _make_run(session_factory)
    with transaction(session_factory) as s:
        attempt = s.get(Attempt, attempt_id)
        assert attempt is not None
        attempt.overrides = {"optimizer.lr": [2e-3, 1e-3]}
        attempt.plan = {"rewarm_steps": 20, "lr_probe": {"candidates": [1e-3, 2.5e-4], "steps": 10}}
        attempt.reason = "attempt 1 diverged; lr 0.002→0.001"
    end = {"outcome": "succeeded", "final_step": 60, "onset_step": None}
    spec = [("lr_probe", PROBED)] if via != "end" else []
    spec += [_metric(50, 1.3), ("end", {**end, "lr_probe": PROBED} if via != "event" else end)]
    events = _events(spec)
    for _ in range(2):
        _ingest(session_factory, run_id, attempt_id, events)
        with transaction(session_factory) as s:
            attempt = s.get(Attempt, attempt_id)
            assert attempt is not None
            assert attempt.overrides == {"optimizer.lr": [2e-3, 2.5e-4]}
            assert attempt.plan["lr_probe"]["chosen"] == 2.5e-4 and attempt.plan["lr_probe"]["steps_run"] == 16
            assert attempt.plan["lr_probe"]["candidates_run"][0]["failed"] == "divergence at step 55"
            assert attempt.plan["rewarm_steps"] == 20
            assert attempt.reason == "attempt 1 diverged; lr 0.002→0.001; " + PROBED["reason"]


def test_a_clean_probe_pick_takes_back_the_retrys_ramps(session_factory: sessionmaker[Session]) -> None:
    """The worker dropped the re-warm and the warmup the retry added (its pick trained cleanly): the stored attempt
    says so, so a crash restart relaunches what it really trained and the next retry tightens from there."""
    run_id, attempt_id = _make_run(session_factory)
    with transaction(session_factory) as s:
        attempt = s.get(Attempt, attempt_id)
        assert attempt is not None
        attempt.overrides = {"optimizer.lr": [2e-3, 1e-3], "schedule.warmup_steps": [None, 15]}
        attempt.plan = {"rewarm_steps": 20, "lr_probe": {"candidates": [1e-3, 2.5e-4], "steps": 10,
                                                         "if_clean": {"schedule.warmup_steps": None}}}
    clean = {**PROBED, "rewarm_steps": 0, "if_clean": {"schedule.warmup_steps": None}}
    _ingest(session_factory, run_id, attempt_id, _events([("lr_probe", clean), _metric(50, 1.3)]))
    with transaction(session_factory) as s:
        attempt = s.get(Attempt, attempt_id)
        assert attempt is not None
        assert attempt.overrides == {"optimizer.lr": [2e-3, 2.5e-4]}
        assert attempt.plan["rewarm_steps"] == 0 and attempt.plan["lr_probe"]["chosen"] == 2.5e-4


# ------------------------------------------------------------------------- the batched path vs the one before
_LOSSES = st.one_of(st.floats(min_value=0.01, max_value=100.0), st.sampled_from([math.nan, math.inf, None]))


@st.composite
def _streams(draw: st.DrawFn) -> tuple[list[list[dict[str, Any]]], int]:
    """One attempt's events cut into deliveries, some redelivered and some out of order; and the downsampling."""
    n = draw(st.integers(min_value=1, max_value=40))
    spec: list[tuple[str, dict[str, Any]]] = []
    for step in range(n):
        spec.append(_metric(step, draw(_LOSSES), skipped=draw(st.booleans()) and step % 5 == 0,
                            grad_norm=draw(st.sampled_from([1.0, math.nan, 2.5])),
                            loss_scale=draw(st.sampled_from([None, 65536.0]))))
        extra = draw(st.sampled_from(["", "", "", "anomaly", "checkpoint", "eval", "layer_stats"]))
        if extra == "anomaly":
            spec.append(("anomaly", {"step": step, "rank": 0, "kind": "loss_spike", "value": math.inf,
                                     "threshold": 6.0, "action": "record", "details": {"z": math.nan}}))
        elif extra == "checkpoint":
            spec.append(("checkpoint", {"step": step, "uri": f"/ckpt/{step}", "sha256": "b" * 64,
                                        "healthy": draw(st.booleans()), "verdict": {"ok": True},
                                        "metrics": {"loss": math.nan}}))
        elif extra == "eval":
            spec.append(("eval", {"step": step, "eval_loss": draw(_LOSSES)}))
        elif extra == "layer_stats":
            spec.append(("layer_stats", {"step": step, "layer_grad_norms": {"b0": 0.5}, "update_ratio": 1e-3}))
    if draw(st.booleans()):
        spec.append(("end", {"outcome": "diverged", "final_step": n - 1, "onset_step": n - 1, "value": math.nan}))
    events = _events(spec)
    cuts = sorted(draw(st.sets(st.integers(min_value=1, max_value=max(1, len(events) - 1)), max_size=4)))
    batches = [events[a:b] for a, b in zip([0, *cuts], [*cuts, len(events)], strict=True)]
    redelivered = [b + batches[i + 1][: len(batches[i + 1]) // 2] if i + 1 < len(batches) else b
                   for i, b in enumerate(batches)]  # a delivery may repeat part of the next one
    order = draw(st.permutations(range(len(redelivered))))
    return [redelivered[i] for i in order] + [draw(st.sampled_from(redelivered))], draw(st.sampled_from([1, 3]))


def _stored(factory: sessionmaker[Session], run_id: int, attempt_id: int) -> dict[str, Any]:
    """Everything ingestion writes for one attempt, without ids and timestamps."""
    skip = {"id", "run_id", "attempt_id", "created_at"}
    out: dict[str, Any] = {}
    with transaction(factory) as s:
        for model in (MetricPoint, AnomalyRow, CheckpointRow, EvalPoint):
            table = model.__table__
            cols = [c for c in table.c if c.name not in skip]
            key = table.c.seq if model is AnomalyRow else table.c.step
            rows = s.execute(sa.select(*cols).where(table.c.attempt_id == attempt_id).order_by(key)).all()
            out[table.name] = [tuple(r) for r in rows]
        run, attempt = s.get(Run, run_id), s.get(Attempt, attempt_id)
        assert run is not None and attempt is not None
        out["run"] = (run.best_loss, run.last_step)
        info = dict(attempt.ray_info)
        newest = info.pop("layer_stats", None)  # before: the newest snapshot only, in ray_info; now: every one
        steps = s.scalars(sa.select(LayerSnapshotRow.step).where(LayerSnapshotRow.attempt_id == attempt_id)).all()
        out["attempt"] = (attempt.last_seq, attempt.last_step, attempt.outcome, attempt.onset_step, info)
        out["newest_layer_step"] = newest["step"] if newest else max(steps, default=None)
    return out


@hyp_settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(stream=_streams())
def test_batched_ingest_writes_what_the_previous_ingest_wrote(
    session_factory: sessionmaker[Session], stream: tuple[list[list[dict[str, Any]]], int]
) -> None:
    """Same deliveries into two attempts, one through today's ingest and one through the code before batching
    (``ingest_before``, a frozen copy): the same rows, the same per-delivery counts, the same aggregates."""
    deliveries, every = stream
    new, old = _make_run(session_factory), _make_run(session_factory)
    for batch in deliveries:
        got = _ingest(session_factory, *new, batch, every)
        with transaction(session_factory) as s:
            run, attempt = s.get(Run, old[0]), s.get(Attempt, old[1])
            assert run is not None and attempt is not None
            want = ingest_before.ingest_events(session=s, run=run, attempt=attempt, events=batch,
                                               metrics_every_steps=every)
        assert asdict(got) == asdict(want) | {"layers": got.layers}
    assert _stored(session_factory, *new) == _stored(session_factory, *old)


@hyp_settings(max_examples=25, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(first=_streams(), second=_streams())
def test_ingest_many_writes_what_one_call_per_attempt_writes(
    session_factory: sessionmaker[Session], first: tuple[list[list[dict[str, Any]]], int],
    second: tuple[list[list[dict[str, Any]]], int],
) -> None:
    """Two attempts' deliveries written together (``ingest_many``: one statement per table, as the scheduler's
    tick does) and the same written one ``ingest_events`` call each, into two other attempts: the same rows, the
    same per-delivery counts per attempt, the same aggregates."""
    every = first[1]
    together, alone = [_make_run(session_factory) for _ in range(2)], [_make_run(session_factory) for _ in range(2)]
    streams = [first[0], second[0]]
    for i in range(max(map(len, streams))):
        batches = [stream[i] if i < len(stream) else [] for stream in streams]
        want = [_ingest(session_factory, *ids, batch, every) for ids, batch in zip(alone, batches, strict=True)]
        with transaction(session_factory) as s:
            items = []
            for (run_id, attempt_id), batch in zip(together, batches, strict=True):
                run, attempt = s.get(Run, run_id), s.get(Attempt, attempt_id)
                assert run is not None and attempt is not None
                items.append((run, attempt, batch))
            got = ingest_many(session=s, batches=items, metrics_every_steps=every)
        assert [asdict(g) for g in got] == [asdict(w) for w in want]
    for ids, other in zip(together, alone, strict=True):
        assert _stored(session_factory, *ids) == _stored(session_factory, *other)


def test_ingest_many_refuses_an_attempt_twice(session_factory: sessionmaker[Session]) -> None:
    run_id, attempt_id = _make_run(session_factory)
    with transaction(session_factory) as s:
        run, attempt = s.get(Run, run_id), s.get(Attempt, attempt_id)
        assert run is not None and attempt is not None
        batch = _events([_metric(0, 1.0)])
        with pytest.raises(ValueError, match="more than one batch"):
            ingest_many(session=s, batches=[(run, attempt, batch), (run, attempt, batch)])


@pytest.mark.ray
@pytest.mark.postgres
@pytest.mark.slow
def test_the_ingest_benchmark_runs_both_variants_end_to_end() -> None:
    """``benchmarks/bench_ingest.py`` at a toy size (its own Ray and database, in a subprocess): both variants
    commit events through the real channels and scheduler, and every pushed event reaches the store."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, str(repo / "benchmarks" / "bench_ingest.py"), "--attempts", "3", "--rate", "300",
         "--seconds", "2", "--warmup", "1", "--drain-timeout", "60", "--pushers", "1", "--json"],
        capture_output=True, text=True, timeout=280, check=True,
    ).stdout
    results = json.loads(out[out.index("["):])
    assert [r["variant"] for r in results] == ["before", "after"]
    for r in results:
        assert r["events_per_s"] > 0 and r["not_ingested_by_the_drain_timeout"] == 0
        assert r["rows"]["metric_points"] + r["rows"]["anomalies"] + r["rows"]["checkpoints"] == r["emitted"]
