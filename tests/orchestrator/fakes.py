"""The scripted compute of the fast scheduler tests (a launcher and channels that behave like ``RayLauncher`` and
``orchestrator.channel.RunChannel`` as the scheduler sees them: events with per-attempt seq numbers, dropped once
acked, open plan requests, the fit's state; ``kill`` makes a channel unreachable) and the helpers around them."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from datetime import timedelta
from functools import partial
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import torch
import yaml
from sqlalchemy.orm import Session, sessionmaker

from contracts.recipe import validate_recipe_data
from orchestrator.scheduler import ChannelLost
from orchestrator.settings import Settings
from orchestrator.store.db import transaction
from orchestrator.store.models import Attempt, Event, Run, utcnow
from orchestrator.store.repo import create_run
from tests import recipes
from workers.checkpoint import save_checkpoint


# ------------------------------------------------------------------------------------------ fake compute
class FakeChannel:
    def __init__(self, name: str, run_id: int, attempt: int, launch: dict[str, Any]) -> None:
        self.name, self.run_id, self.first_attempt, self.launch = name, run_id, attempt, launch
        self.events: list[dict[str, Any]] = []
        self.seq: dict[int, int] = {}
        self.requests: dict[int, dict[str, Any]] = {}
        self.answers: dict[int, dict[str, Any] | None] = {}
        self.fit: dict[str, Any] = {"state": "running", "error": None}
        self.stop = False
        self.killed = False

    def emit(self, attempt: int, type: str, data: dict[str, Any]) -> None:
        self.seq[attempt] = self.seq.get(attempt, 0) + 1
        self.events.append({"attempt": attempt, "seq": self.seq[attempt], "type": type, "data": data})

    def metrics(self, attempt: int, steps: range, loss: float = 2.0) -> None:
        for step in steps:
            self.emit(attempt, "metric", {"step": step, "loss": loss, "grad_norm": 1.0, "lr": 1e-3,
                                          "skipped": False})

    def checkpoint(self, attempt: int, step: int, root: Path, healthy: bool = True) -> str:
        """A real (tiny) checkpoint on disk, announced like the engine does; returns its path."""
        info = save_checkpoint(root / f"a{attempt}" / f"step_{step:08d}", {"model": {"w": torch.ones(2)}},
                               meta={"step": step, "healthy": healthy})
        self.emit(attempt, "checkpoint", {"step": step, "uri": str(info.path), "sha256": info.sha256,
                                          "healthy": healthy, "verdict": {"weights_finite": True}, "metrics": {}})
        return str(info.path)

    def diverge(self, attempt: int, onset: int, kind: str = "divergence") -> dict[str, Any]:
        """A rollback at ``onset``; by default a loss divergence (the policy lowers the LR first for it)."""
        self.emit(attempt, "anomaly", {"step": onset, "rank": 0, "kind": kind,
                                       "detector": "loss_spike", "value": 9e3, "threshold": 6.0,
                                       "action": "rollback", "details": {}})
        end = {"outcome": "diverged", "final_step": onset, "onset_step": onset, "detector": kind,
               "value": 9e3, "reason": "spike", "median_grad_norm": 1.0, "loss_scale_collapsed": False}
        self.emit(attempt, "end", end)
        return end

    def preflight(self, status: str = "ok", error: str | None = None) -> None:
        """What the channel's preflight probe reported; a config error ends the fit without a trainer (as
        ``RunChannel._run_fit`` does), any other status lets the fit go on."""
        result = {"status": status, "seconds": 0.5, "error": error}
        if status == "config_error":
            self.fit = {"state": "failed", "error": error, "config_error": error, "stage": "preflight",
                        "preflight": result}
        else:
            self.fit = {**self.fit, "preflight": result}

    def setup_error(self, attempt: int, message: str, *, with_end: bool = True) -> None:
        """The workers' setup hit a config error (``workers.entry.report_config_error``): rank 0's ``config_error``
        end (unless its sink was lost), then every rank raised ``SetupConfigError``."""
        if with_end:
            self.emit(attempt, "end", {"outcome": "config_error", "final_step": 0, "reason": message})
        kept = {"preflight": self.fit["preflight"]} if "preflight" in self.fit else {}
        self.fit = {"state": "failed", "error": f"SetupConfigError: {message}", **kept,
                    "worker_failures": [{"rank": r, "type": "SetupConfigError", "message": message, "died": False}
                                        for r in range(int(self.launch["num_workers"]))]}

    def succeed(self, attempt: int, final: int) -> None:
        self.emit(attempt, "end", {"outcome": "succeeded", "final_step": final, "onset_step": None})
        self.fit = {"state": "done", "error": None}


class FakeLauncher:
    def __init__(self, cpus: float = 8.0, total_cpus: float | None = None) -> None:
        self.cpus = cpus
        self.total_cpus = total_cpus
        """The whole cluster (busy or not); None: ``cpus``."""
        self.channels: dict[str, FakeChannel] = {}
        self.launches: list[FakeChannel] = []
        self.lock = threading.Lock()

    def connect(self) -> None:
        return None

    def shutdown(self) -> None:
        return None

    def free_cpus(self) -> float | None:
        busy = sum(c.launch["num_workers"] * c.launch["cpus_per_worker"] for c in self.channels.values()
                   if not c.killed and c.fit["state"] == "running")
        return float(self.cpus - busy)

    def capacity(self) -> dict[str, float] | None:
        return {"CPU": float(self.total_cpus if self.total_cpus is not None else self.cpus), "GPU": 0.0}

    def launch(self, *, name: str, run_id: int, attempt: int, launch: dict[str, Any]) -> FakeChannel:
        ch = FakeChannel(name, run_id, attempt, launch)
        with self.lock:
            self.channels[name] = ch
            self.launches.append(ch)
        return ch

    def attach(self, name: str) -> FakeChannel | None:
        ch = self.channels.get(name)
        return ch if ch is not None and not ch.killed else None

    def poll(self, handle: FakeChannel, acked: Mapping[int, int]) -> dict[str, Any] | None:
        if handle.killed:
            raise ChannelLost("actor died")
        handle.events = [e for e in handle.events if e["seq"] > acked.get(e["attempt"], 0)]
        return {"events": list(handle.events),
                "plan_requests": [r for a, r in handle.requests.items() if a not in handle.answers],
                "fit": dict(handle.fit), "stop": handle.stop}

    def request_stop(self, handle: FakeChannel) -> None:
        handle.stop = True

    def answer_plan(self, handle: FakeChannel, attempt: int, plan: dict[str, Any] | None) -> None:
        handle.answers[attempt] = plan

    def kill(self, handle: FakeChannel) -> None:
        handle.killed = True

    def standby_for(self, launch: Mapping[str, Any]) -> str | None:
        return None  # no standby worker groups: the Ray launcher's are tested against Ray

    def keep_standby(self, template: Mapping[str, Any], free_cpus: float | None) -> None:
        return None

    def of_run(self, run_id: int) -> list[FakeChannel]:
        return [c for c in self.launches if c.run_id == run_id]


# ---------------------------------------------------------------------------------------------- helpers
RECIPE: dict[str, Any] = {
    "name": "sched-test",
    "model": {"name": "tiny_gpt", "vocab_size": 16, "context": 8, "n_layers": 1, "n_heads": 1, "d_model": 8},
    "data": {"name": "markov", "vocab_size": 16, "seq_len": 8},
    "training": {"max_steps": 100},
    "optimizer": {"name": "adamw", "lr": 0.002},
    "checkpoint": {"every_steps": 10, "keep": 2},
    "recovery": {"max_retries": 2, "max_crash_restarts": 2},
}


recipe_doc = partial(recipes.recipe_doc, RECIPE)


def submit(factory: sessionmaker[Session], doc: dict[str, Any] | None = None) -> int:
    doc = doc or recipe_doc()
    with transaction(factory) as s:
        run, _ = create_run(session=s, owner="alice", recipe=validate_recipe_data(doc), text=yaml.safe_dump(doc))
        return run.id


def make_settings(db_url: str, tmp_path: Path, **kw: Any) -> Settings:
    kw.setdefault("max_concurrent_runs", 4)
    return Settings(home=tmp_path, database_url=db_url, checkpoint_root=str(tmp_path / "ckpt"),
                    scheduler_poll_seconds=0.1, **kw)


def load(factory: sessionmaker[Session], run_id: int) -> Run:
    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        _ = [a.outcome for a in run.attempts]  # load while the session is open
        return run


def attempts(factory: sessionmaker[Session], run_id: int) -> list[Attempt]:
    with transaction(factory) as s:
        return list(s.scalars(sa.select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)))


def run_events(factory: sessionmaker[Session], run_id: int) -> list[tuple[str, str | None, str]]:
    with transaction(factory) as s:
        rows = s.scalars(sa.select(Event).where(Event.run_id == run_id).order_by(Event.id))
        return [(e.entity, e.from_state, e.to_state) for e in rows]


def ckpt_path(tmp_path: Path, step: int, attempt: int = 1) -> str:
    return str(tmp_path / "ckpt" / f"a{attempt}" / f"step_{step:08d}")


def orphan(factory: sessionmaker[Session], run_id: int) -> None:
    """What a dead scheduler leaves behind: its claim, with the lease lapsed."""
    with transaction(factory) as s:
        s.execute(sa.update(Run).where(Run.id == run_id)
                  .values(claimed_by="other-host:1:dead", lease_expires_at=utcnow() - timedelta(seconds=5)))
