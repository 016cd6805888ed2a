"""Fixtures shared by the worker-engine tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def fixtures_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make ``tests/workers/ballast_custom_fixtures.py`` importable for the custom-import tests."""
    monkeypatch.syspath_prepend(str(Path(__file__).parent))
