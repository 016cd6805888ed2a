"""Numbers no recipe can hold are client errors, never a 500: an integer past Python's 4,300-digit conversion limit
or outside 64 bits, in YAML or JSON, on submission and on validation."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

HUGE = "9" * 5000


@pytest.mark.parametrize("path", ["/api/v1/runs", "/api/v1/recipes:validate"])
@pytest.mark.parametrize(("media", "body"), [
    ("application/yaml", f"name: t\ntraining:\n  seed: {HUGE}\n"),
    ("application/json", f'{{"name": "t", "training": {{"seed": {HUGE}}}}}'),
    ("application/json", '{"name": "t", "training": {"seed": 18446744073709551616}}'),
], ids=["yaml-5000-digits", "json-5000-digits", "json-2**64"])
def test_an_integer_no_recipe_can_hold_is_422(client: TestClient, path: str, media: str, body: str) -> None:
    r = client.post(path, content=body, headers={"content-type": media})
    assert r.status_code == 422, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    assert r.json()["errors"]
    assert client.get("/healthz").status_code == 200  # and the connection still serves the next request
