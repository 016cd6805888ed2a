"""Property-based tests of the API against its own OpenAPI document (schemathesis 4).

For every operation, schemathesis generates valid and invalid requests (bounded: 25 examples each) and checks
that no response is a 5xx and that every response matches what the document promises: status code, content
type, headers and body schema. SQLite only (the property is about the HTTP layer; the store is tested on both
backends elsewhere). The event stream is excluded here (it streams until the run finishes) and has its own tests.

The app is built at import (schemathesis reads its OpenAPI document while collecting); its database is attached
by a module fixture. ``schemathesis.pytest.from_fixture`` would be neater but fails on pytest 9 (4.32.5).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import checks
from sqlalchemy.orm import sessionmaker

import migrations
from api.app import create_app
from orchestrator.settings import Settings
from orchestrator.store.db import make_engine, make_session_factory

pytestmark = pytest.mark.slow  # every operation, 25 generated requests each: tens of seconds

# an unbound session factory until the fixture attaches the real one (so the lifespan builds no engine)
APP = create_app(Settings(database_url="sqlite:///:memory:"), sessionmaker())
schema = schemathesis.openapi.from_asgi("/openapi.json", APP).exclude(path_regex=r"/events$")
# the coverage phase enumerates every boundary case of the (large) recipe schema: minutes per recipe endpoint;
# explicit examples plus bounded fuzzing (positive and negative data) keep this test in CI's budget
schema.config.phases.update(phases=["examples", "fuzzing"])

CHECKS = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_schema_conformance,
    checks.response_headers_conformance,
]


@pytest.fixture(scope="module", autouse=True)
def _database(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    home: Path = tmp_path_factory.mktemp("schemathesis")
    url = f"sqlite:///{home / 'api.db'}"
    migrations.upgrade(url)
    engine = make_engine(url)
    APP.state.session_factory = make_session_factory(engine)
    yield
    APP.state.session_factory = None
    engine.dispose()


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_conforms_to_its_openapi(case: schemathesis.Case[Any]) -> None:
    case.call_and_validate(checks=CHECKS)
