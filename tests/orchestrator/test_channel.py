"""The event channel (``RunChannel``) and the worker's ``ActorSink``.

The channel's bookkeeping is tested as a plain class; the sink against a real channel actor on the session's
Ray (no Train worker group: a few actor calls), since batching, the background stop flag and the plan handshake
are about Ray calls.
"""

from __future__ import annotations

import pickle
import threading
import time
from typing import Any

import pytest

import orchestrator.channel as channel_mod
from orchestrator.channel import NAMESPACE, RunChannel, channel_actor_class
from workers.ray_sink import ActorSink


def ev(attempt: int, seq: int, type: str = "metric", step: int | None = None) -> dict[str, Any]:
    return {"attempt": attempt, "seq": seq, "type": type, "data": {"step": seq if step is None else step}}


def test_drain_returns_everything_not_yet_acknowledged() -> None:
    ch = RunChannel(run_id=7, first_attempt=1)
    ch.push([ev(1, 1), ev(1, 2)])
    ch.push([ev(1, 3), ev(2, 1)])
    assert [(e["attempt"], e["seq"]) for e in ch.drain()] == [(1, 1), (1, 2), (1, 3), (2, 1)]
    # drained but not committed: delivered again
    assert len(ch.drain()) == 4
    assert [(e["attempt"], e["seq"]) for e in ch.drain({1: 2})] == [(1, 3), (2, 1)]
    assert ch.drain({1: 3, 2: 1}) == []


def test_the_plan_handshake() -> None:
    ch = RunChannel(run_id=7, first_attempt=1)
    assert ch.poll()["plan_requests"] == []
    ch.request_plan(1, {"outcome": "diverged", "onset_step": 35})
    assert ch.get_plan(1) == {"answered": False, "plan": None}
    assert ch.poll()["plan_requests"] == [{"attempt": 1, "end": {"outcome": "diverged", "onset_step": 35}}]
    ch.answer_plan(1, {"attempt": 2, "spec": {}})
    assert ch.get_plan(1) == {"answered": True, "plan": {"attempt": 2, "spec": {}}}
    assert ch.poll()["plan_requests"] == []  # answered requests are not offered again


def test_a_stop_request_answers_an_open_plan_request_with_none() -> None:
    ch = RunChannel(run_id=7, first_attempt=1)
    ch.request_plan(1, {"outcome": "diverged"})
    ch.request_stop()
    assert ch.should_stop() and ch.get_plan(1) == {"answered": True, "plan": None}


def test_an_undrained_backlog_drops_old_metrics_first(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(channel_mod, "MAX_BUFFERED_EVENTS", 5)
    ch = RunChannel(run_id=7, first_attempt=1)
    ch.push([ev(1, 1, "checkpoint"), ev(1, 2), ev(1, 3), ev(1, 4, "anomaly"), ev(1, 5), ev(1, 6), ev(1, 7, "end")])
    kept = ch.poll()
    assert [e["seq"] for e in kept["events"]] == [1, 4, 5, 6, 7]
    assert kept["dropped_metrics"] == 2


@pytest.mark.ray
@pytest.mark.parametrize(("status", "trainer_started", "state"), [
    ("config_error", False, "failed"), ("inconclusive", True, "done"), ("ok", True, "done"),
])
def test_the_preflight_runs_before_the_trainer_and_a_config_error_starts_none(
    monkeypatch: pytest.MonkeyPatch, status: str, trainer_started: bool, state: str
) -> None:
    calls: list[str] = []

    def preflight(launch: Any) -> dict[str, Any]:
        calls.append("preflight")
        return {"status": status, "seconds": 0.1, "error": None if status == "ok" else "data.factory: x"}

    monkeypatch.setattr(channel_mod, "run_preflight", preflight)
    monkeypatch.setattr(channel_mod, "run_torch_trainer", lambda launch, handle: calls.append("trainer"))
    ch = RunChannel(run_id=7, first_attempt=1)
    ch._run_fit({"preflight": {"timeout_s": 5}}, None)
    assert calls == (["preflight", "trainer"] if trainer_started else ["preflight"])
    fit = ch.fit_status()
    assert fit["state"] == state and fit["preflight"]["status"] == status
    assert (fit.get("config_error"), fit.get("stage")) == (
        ("data.factory: x", "preflight") if status == "config_error" else (None, None))


def test_a_broken_probe_never_keeps_the_fit_from_starting(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def broken(launch: Any) -> dict[str, Any]:
        raise ValueError("bad options")

    monkeypatch.setattr(channel_mod, "run_preflight", broken)
    monkeypatch.setattr(channel_mod, "run_torch_trainer", lambda launch, handle: calls.append("trainer"))
    ch = RunChannel(run_id=7, first_attempt=1)
    ch._run_fit({"preflight": {"timeout_s": 5}}, None)
    assert calls == ["trainer"]
    assert ch.fit_status()["state"] == "done" and ch.fit_status()["preflight"]["status"] == "inconclusive"


def test_no_preflight_unless_the_launch_asks(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(channel_mod, "run_preflight", lambda launch: calls.append("preflight"))
    monkeypatch.setattr(channel_mod, "run_torch_trainer", lambda launch, handle: calls.append("trainer"))
    RunChannel(run_id=7, first_attempt=1)._run_fit({}, None)
    assert calls == ["trainer"]


def test_the_sink_batches_to_the_actor_and_follows_the_plan(ray_cluster: Any) -> None:
    handle = channel_actor_class().options(namespace=NAMESPACE).remote(1, 1)
    try:
        sink = pickle.loads(pickle.dumps(ActorSink(handle, attempt=1, flush_interval=60.0, max_batch=3)))
        sink.emit("metric", {"step": 0})
        sink.emit("metric", {"step": 1})
        assert ray_cluster.get(handle.drain.remote()) == []  # still buffered: neither 3 events nor 60 s
        sink.emit("metric", {"step": 2})  # the third fills the batch
        deadline = time.monotonic() + 60
        while len(ray_cluster.get(handle.drain.remote())) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        got = ray_cluster.get(handle.drain.remote())
        assert [(e["attempt"], e["seq"], e["data"]["step"]) for e in got] == [(1, 1, 0), (1, 2, 1), (1, 3, 2)]
        assert all(isinstance(e["ts"], float) for e in got)

        # the stop flag arrives through a background refresh, without blocking should_stop
        sink.stop_poll_interval = 0.0
        ray_cluster.get(handle.request_stop.remote())
        deadline = time.monotonic() + 60
        while not sink.should_stop() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sink.should_stop()
    finally:
        ray_cluster.kill(handle)


@pytest.mark.ray
def test_request_plan_waits_for_the_answer_and_switches_attempt(ray_cluster: Any) -> None:
    handle = channel_actor_class().options(namespace=NAMESPACE).remote(1, 1)
    try:
        sink = ActorSink(handle, attempt=1, flush_interval=60.0)
        sink.emit("metric", {"step": 34})
        end = {"outcome": "diverged", "onset_step": 35}
        sink.emit("end", end)  # the end event is delivered before the request

        def orchestrator() -> None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                polled = ray_cluster.get(handle.poll.remote())
                if polled["plan_requests"]:
                    assert [e["type"] for e in polled["events"]] == ["metric", "end"]
                    ray_cluster.get(handle.answer_plan.remote(1, {"attempt": 2, "spec": {"attempt": 2}}))
                    return
                time.sleep(0.05)

        answerer = threading.Thread(target=orchestrator)
        answerer.start()
        plan = sink.request_plan(end, timeout=60)
        answerer.join(60)
        assert plan == {"attempt": 2, "spec": {"attempt": 2}}
        sink.emit("metric", {"step": 30})
        sink.flush()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            newest = ray_cluster.get(handle.drain.remote({1: 2}))
            if newest:
                break
            time.sleep(0.05)
        assert [(e["attempt"], e["seq"]) for e in newest] == [(2, 1)]  # a new attempt counts from 1
    finally:
        ray_cluster.kill(handle)


@pytest.mark.ray
def test_request_plan_gives_up_after_its_timeout(ray_cluster: Any) -> None:
    handle = channel_actor_class().options(namespace=NAMESPACE).remote(1, 1)
    try:
        sink = ActorSink(handle, attempt=1)
        assert sink.request_plan({"outcome": "diverged"}, timeout=0.3) is None
        assert sink.attempt == 1
    finally:
        ray_cluster.kill(handle)
