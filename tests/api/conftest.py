"""API test fixtures: the real app over the ``session_factory`` of each backend, with auth off or on."""

from __future__ import annotations

import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from sqlalchemy.orm import Session, sessionmaker

from api.app import create_app
from api.auth import issue_token
from orchestrator.settings import Settings
from tests.ports import free_port

with warnings.catch_warnings():
    # starlette's TestClient warns that plain httpx is deprecated in favour of httpx2 (not installed here)
    warnings.simplefilter("ignore")
    from fastapi.testclient import TestClient

PEPPER = "test-pepper-not-the-default"

YAML_RECIPE = """\
apiVersion: ballast/v1
kind: StabilityRecipe
name: demo
model:
  name: tiny_gpt
  n_layers: 2
data:
  name: markov
training:
  max_steps: 100
optimizer:
  name: adamw
  lr: 0.003
"""


def settings_for(db_url: str, tmp_path: Path, **kw: Any) -> Settings:
    return Settings(database_url=db_url, home=tmp_path, token_pepper=PEPPER, **kw)


@pytest.fixture
def make_client(
    db_url: str, session_factory: sessionmaker[Session], tmp_path: Path
) -> Iterator[Callable[..., TestClient]]:
    """``make_client(auth=False, **settings)`` → a TestClient of a fresh app on this test's database."""
    clients: list[TestClient] = []

    def make(auth: bool = False, **kw: Any) -> TestClient:
        settings = settings_for(db_url, tmp_path, auth_mode="token" if auth else "off", **kw)
        app = create_app(settings, session_factory)
        app.state.event_poll_seconds = 0.02
        client = TestClient(app)
        client.__enter__()  # the lifespan runs, as under a server: on PostgreSQL it opens the app's read pool
        clients.append(client)
        return client

    yield make
    for c in clients:
        c.__exit__(None, None, None)


@pytest.fixture
def client(make_client: Callable[..., TestClient]) -> TestClient:
    """Auth off (the loopback default): every request is the principal ``local`` with all scopes."""
    return make_client()


@pytest.fixture
def make_token(session_factory: sessionmaker[Session]) -> Callable[..., dict[str, str]]:
    """``make_token(principal, *scopes)`` → Authorization headers for a new token."""

    def make(principal: str, *scopes: str) -> dict[str, str]:
        with session_factory() as session:
            _, token = issue_token(session=session, pepper=PEPPER, name=f"{principal}-tok", principal=principal,
                                   scopes=list(scopes))
            session.commit()
        return {"Authorization": f"Bearer {token}"}

    return make


def post_yaml(client: TestClient, text: str = YAML_RECIPE, path: str = "/api/v1/runs", **headers: str) -> Any:
    return client.post(path, content=text, headers={"content-type": "application/yaml", **headers})


# ------------------------------------------------------------------------------- rows the scheduler would write
def seed_run(
    factory: sessionmaker[Session], *, owner: str = "local", name: str = "demo", state: str = "queued",
    created_at: Any = None,
) -> int:
    """A run (and its recipe row) inserted directly, in any state, as the scheduler would leave it."""
    from contracts.recipe import load_recipe
    from orchestrator.store import repo
    from orchestrator.store.models import Run

    with factory() as session:
        recipe = load_recipe(YAML_RECIPE.replace("name: demo", f"name: {name}"))
        row = repo.create_recipe(session=session, owner=owner, recipe=recipe, text=YAML_RECIPE)
        kw: dict[str, Any] = {"created_at": created_at, "updated_at": created_at} if created_at else {}
        run = Run(recipe_id=row.id, name=name, owner=owner, state=state, **kw)
        session.add(run)
        session.commit()
        return run.id


def seed_attempt(
    factory: sessionmaker[Session], run_id: int, number: int, *, state: str = "running", kind: str = "initial",
    overrides: dict[str, Any] | None = None,
) -> int:
    from orchestrator.store.models import Attempt, Run

    with factory() as session:
        att = Attempt(run_id=run_id, number=number, state=state, kind=kind, overrides=overrides or {})
        session.add(att)
        run = session.get(Run, run_id)
        assert run is not None
        run.current_attempt = number
        session.commit()
        return att.id


@pytest.fixture
def make_server(
    db_url: str, session_factory: sessionmaker[Session], tmp_path: Path
) -> Iterator[Callable[..., str]]:
    """``make_server(auth=False)`` → base URL of the app served by uvicorn in a thread (scheduler not started)."""
    servers: list[tuple[uvicorn.Server, threading.Thread]] = []

    def make(auth: bool = False) -> str:
        settings = settings_for(db_url, tmp_path, auth_mode="token" if auth else "off")
        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(create_app(settings, session_factory), host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        servers.append((server, thread))
        return f"http://127.0.0.1:{port}"

    yield make
    for server, thread in servers:
        server.should_exit = True
        thread.join(timeout=10)


@pytest.fixture
def url(make_server: Callable[..., str]) -> str:
    """The base URL of a live server (auth off) on this test's database."""
    return make_server()
