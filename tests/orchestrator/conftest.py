"""Fixtures of the fast scheduler tests: the scripted launcher and a scheduler factory over it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session, sessionmaker

from orchestrator.scheduler import Scheduler
from tests.orchestrator.fakes import FakeLauncher, make_settings


@pytest.fixture
def launcher() -> FakeLauncher:
    return FakeLauncher()


@pytest.fixture
def make_scheduler(db_url: str, tmp_path: Path, session_factory: sessionmaker[Session],
                   launcher: FakeLauncher) -> Any:
    def make(scheduler_id: str = "sched-a", **kw: Any) -> Scheduler:
        return Scheduler(make_settings(db_url, tmp_path, **kw), session_factory, scheduler_id, launcher=launcher)

    return make
