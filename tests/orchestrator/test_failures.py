"""Crash summaries: from Ray Train's per-rank failures (``WorkerGroupError.worker_failures``, real exception objects
of the installed Ray, no cluster needed) as the channel records them, and from the error text only where no such
structure exists."""

from __future__ import annotations

import pickle
from typing import Any

import pytest

import orchestrator.channel as channel_mod
from contracts.wire import one_line
from orchestrator.channel import RunChannel, WorkerFailure, worker_failures
from orchestrator.scheduler.failures import DIED, Failure, summarize_error


def _worker_group_error(failures: dict[int, BaseException]) -> Exception:
    from ray.train.v2.api.exceptions import WorkerGroupError

    return WorkerGroupError("the ranks' snippets", failures)


def _dead_worker() -> BaseException:
    from ray.exceptions import ActorDiedError
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    return WorkerHealthCheckFailedError("A worker health check failed.\nWorker info: rank 1", ActorDiedError())


# ------------------------------------------------------------------------------------------ the structure
def test_the_channel_keeps_each_ranks_failure_as_plain_values() -> None:
    exc = _worker_group_error({1: _dead_worker(), 0: RuntimeError("Connection reset by peer")})
    got = worker_failures(pickle.loads(pickle.dumps(exc)))  # as it crosses Ray's process boundary
    assert [(w.rank, w.type, w.died) for w in got] == [(0, "RuntimeError", False),
                                                       (1, "WorkerHealthCheckFailedError", True)]
    assert got[0].message == "Connection reset by peer"
    assert [WorkerFailure.from_dict(w.to_dict()) for w in got] == got
    assert worker_failures(RuntimeError("no ranks here")) == []


def test_a_failed_fit_records_the_text_and_the_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(launch: Any, channel: Any) -> None:
        raise _worker_group_error({0: ValueError("bad batch")})

    monkeypatch.setattr(channel_mod, "run_torch_trainer", fail)
    ch = RunChannel(run_id=7, first_attempt=1)
    ch._run_fit({}, None)
    fit = ch.fit_status()
    assert fit["state"] == "failed" and "Training failed due to worker errors" in fit["error"]
    assert fit["worker_failures"] == [{"rank": 0, "type": "ValueError", "message": "bad batch", "died": False}]
    assert Failure.of_fit(fit).summary() == "ValueError: bad batch"


def test_a_dead_rank_is_the_cause_whatever_the_others_say() -> None:
    workers = (WorkerFailure(0, "RuntimeError", "Connection reset by peer", False),
               WorkerFailure(2, "WorkerHealthCheckFailedError", "A worker health check failed.", True))
    text = "text that a regex would read differently: KeyError: 'x'"
    assert Failure(text, workers).summary() == DIED.format(rank=2) == (
        "worker rank 2 died (its process exited: killed, out of memory or crashed)")


def test_otherwise_the_lowest_failed_rank_in_one_line() -> None:
    workers = (WorkerFailure(3, "KeyError", "'b'", False),
               WorkerFailure(1, "CorruptCheckpoint", "corrupt checkpoint /c/20: model.pt sha256 mismatch\nmore", False))
    assert Failure("", workers).summary() == "CorruptCheckpoint: corrupt checkpoint /c/20: model.pt sha256 mismatch"
    assert Failure("", (WorkerFailure(0, "SystemExit", "", False),)).summary() == "SystemExit"


# ------------------------------------------------------------------------------------ the text, as a fallback
@pytest.mark.parametrize(("text", "summary"), [
    ("ray.train.WorkerGroupError: Training failed due to worker errors:\n[Rank 0 Error Snippet]:\n"
     "The actor died unexpectedly before finishing this task.\n", DIED.format(rank=0)),
    ("Training failed due to worker errors:\n[Rank 1 Error Snippet]:\nTraceback (most recent call last):\n"
     '  File "x.py", line 1\nworkers.faults.InjectedCrash: injected crash at step 25\n',
     "InjectedCrash: injected crash at step 25"),
    ("RuntimeError: boom", "RuntimeError: boom"),
    ("killed: the workers did not stop in time", "killed: the workers did not stop in time"),
    ("", "no error recorded"),
])
def test_summaries_from_the_text_where_no_structure_exists(text: str, summary: str) -> None:
    assert summarize_error(text) == summary
    assert Failure(text).summary() == summary


def test_one_line() -> None:
    assert one_line("Traceback (most recent call last):\n  x\nValueError: nope") == "ValueError: nope"
    assert one_line(None) == "no details"
    assert one_line("x" * 400) == "x" * 299 + "…"
