"""Driving the real scheduler over a SQLite store until a run ends: shared by the object-store end-to-end test
and the multi-node script (which runs in its own process, with its own Ray cluster)."""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import sqlalchemy as sa
import yaml
from sqlalchemy.orm import Session, sessionmaker

import migrations
from contracts.recipe import validate_recipe_data
from orchestrator.scheduler import Scheduler
from orchestrator.settings import Settings
from orchestrator.store.db import make_engine, make_session_factory, transaction
from orchestrator.store.models import Attempt, CheckpointRow, Run
from orchestrator.store.repo import create_run
from tests.recipes import recipe_doc

DEADLINE_S = 480.0  # generous: the machine is shared; nothing asserts on time

TINY: dict[str, Any] = {
    "name": "tiny-s3",
    "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 1, "n_heads": 2, "d_model": 32},
    "data": {"name": "markov", "vocab_size": 32, "seq_len": 16},
    "training": {"max_steps": 50, "batch_size": 8, "seed": 1},
    "optimizer": {"name": "adamw", "lr": 0.003},
    "schedule": {"warmup_steps": 5, "decay": "constant"},
    "checkpoint": {"every_steps": 10, "keep": 2},
    "detectors": {"grad_norm_spike": {"action": "rollback", "warmup_steps": 10}},
    "recovery": {"rewarm_steps": 5},
    "success": {"min_progress": 0.0, "early_min_progress": 0.0},  # mechanics, not learning
    "faults": [],
}
tiny_recipe = partial(recipe_doc, TINY)


def make_store(tmp_path: Path, **settings: Any) -> tuple[Settings, sessionmaker[Session]]:
    s = Settings(home=tmp_path, database_url=f"sqlite:///{tmp_path / 'ballast.db'}", scheduler_poll_seconds=0.3,
                 **settings)
    migrations.upgrade(s.database_url)
    return s, make_session_factory(make_engine(s.database_url))


def submit(factory: sessionmaker[Session], doc: dict[str, Any]) -> int:
    with transaction(factory) as s:
        run, _ = create_run(session=s, owner="tester", recipe=validate_recipe_data(doc), text=yaml.safe_dump(doc))
        return run.id


def run_state(factory: sessionmaker[Session], run_id: int) -> tuple[str, str | None]:
    with transaction(factory) as s:
        run = s.get(Run, run_id)
        assert run is not None
        return run.state, run.reason


def drive(scheduler: Scheduler, factory: sessionmaker[Session], run_id: int,
          until: Callable[[str], bool] = lambda state: state in ("succeeded", "failed", "cancelled")) -> str:
    stop_at = time.monotonic() + DEADLINE_S
    while time.monotonic() < stop_at:
        scheduler.tick()
        state, _ = run_state(factory, run_id)
        if until(state):
            return state
        time.sleep(0.3)
    raise AssertionError(f"run {run_id} did not end; last state {run_state(factory, run_id)}")


def attempts_of(factory: sessionmaker[Session], run_id: int) -> list[Attempt]:
    with transaction(factory) as s:
        return list(s.scalars(sa.select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.number)))


def checkpoints_of(factory: sessionmaker[Session], run_id: int) -> list[CheckpointRow]:
    with transaction(factory) as s:
        return list(s.scalars(sa.select(CheckpointRow).where(CheckpointRow.run_id == run_id)
                              .order_by(CheckpointRow.id)))
