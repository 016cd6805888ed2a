"""POST /api/v1/recipes:validate and the recipe-body rules shared with POST /runs (size, type, parsing)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator

import pytest
from fastapi.testclient import TestClient

from contracts.recipe import load_recipe, recipe_to_dict
from orchestrator.store.repo import content_hash
from tests.api.conftest import YAML_RECIPE, post_yaml

VALIDATE = "/api/v1/recipes:validate"


def test_valid_yaml_returns_normalised_recipe_with_defaults_and_hash(client: TestClient) -> None:
    r = post_yaml(client, path=VALIDATE)
    assert r.status_code == 200
    body = r.json()
    expected = recipe_to_dict(load_recipe(YAML_RECIPE))
    assert body["recipe"] == expected
    assert body["recipe"]["model"]["d_model"] == 64  # a default that the document did not spell out
    assert body["content_hash"] == content_hash(expected)
    assert body["warnings"] == []


@pytest.mark.parametrize("media", ["application/json", "application/json; charset=utf-8"])
def test_json_body_is_accepted_and_hashes_like_the_same_yaml(client: TestClient, media: str) -> None:
    doc = recipe_to_dict(load_recipe(YAML_RECIPE))
    r = client.post(VALIDATE, content=json.dumps(doc), headers={"content-type": media})
    assert r.status_code == 200
    assert r.json()["content_hash"] == post_yaml(client, path=VALIDATE).json()["content_hash"]


@pytest.mark.parametrize("media", ["application/x-yaml", "text/yaml"])
def test_other_yaml_media_types(client: TestClient, media: str) -> None:
    r = client.post(VALIDATE, content=YAML_RECIPE, headers={"content-type": media})
    assert r.status_code == 200
    assert r.json()["recipe"]["name"] == "demo"


def test_warnings_are_reported(client: TestClient) -> None:
    text = YAML_RECIPE + "clipping:\n  method: none\ndetectors:\n  grad_norm_spike:\n    action: record\n"
    r = post_yaml(client, text, path=VALIDATE)
    assert r.status_code == 200
    assert any(w.startswith("clipping.method") for w in r.json()["warnings"])


def test_invalid_value_names_field_and_line(client: TestClient) -> None:
    r = post_yaml(client, YAML_RECIPE.replace("lr: 0.003", "lr: -1"), path=VALIDATE)
    assert r.status_code == 422
    assert r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["type"] == "urn:ballast:problem:invalid-recipe"
    assert body["status"] == 422
    assert body["errors"] == [{"path": "optimizer.lr", "message": "Input should be greater than 0", "line": 13}]


def test_unknown_field_is_422_with_its_path(client: TestClient) -> None:
    r = post_yaml(client, YAML_RECIPE.replace("  lr: 0.003", "  lr: 0.003\n  lr_typo: 1"), path=VALIDATE)
    assert r.status_code == 422
    assert r.json()["errors"] == [{"path": "optimizer.lr_typo", "message": "unknown field", "line": 14}]


def test_unknown_field_in_json_names_the_path(client: TestClient) -> None:
    doc = {"name": "x", "training": {"max_steps": 10, "bogus": True}}
    r = client.post(VALIDATE, json=doc)
    assert r.status_code == 422
    assert {"path": "training.bogus", "message": "unknown field"} in r.json()["errors"]


def test_cross_field_errors_each_named(client: TestClient) -> None:
    r = post_yaml(client, YAML_RECIPE.replace("  name: markov", "  name: markov\n  vocab_size: 10"), path=VALIDATE)
    assert r.status_code == 422
    paths = [e["path"] for e in r.json()["errors"]]
    assert paths == ["data.vocab_size"]


def test_yaml_bomb_is_refused_without_expanding(client: TestClient) -> None:
    bomb = 'a: &a ["x","x","x","x","x","x","x","x","x"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n' + "\n".join(
        f"{chr(99 + i)}: &{chr(99 + i)} [" + ",".join([f"*{chr(98 + i)}"] * 9) + "]" for i in range(7)
    )
    r = post_yaml(client, bomb, path=VALIDATE)
    assert r.status_code == 422
    (err,) = r.json()["errors"]
    assert err["path"] == "<document>"
    assert "aliases are not allowed" in err["message"]


def test_duplicate_keys_refused_in_yaml_and_json(client: TestClient) -> None:
    r = post_yaml(client, "name: a\nname: b\n", path=VALIDATE)
    assert r.status_code == 422
    assert "duplicate key 'name'" in r.json()["errors"][0]["message"]
    r = client.post(VALIDATE, content='{"name": "a", "name": "b"}', headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["errors"] == [{"path": "<document>", "message": "duplicate key 'name'"}]


def test_deeply_nested_document_is_422_not_500(client: TestClient) -> None:
    deep = '{"name": "x", "description": ' + "[" * 50_000 + "]" * 50_000 + "}"
    r = client.post(VALIDATE, content=deep, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["errors"][0]["path"] == "<document>"
    r = post_yaml(client, "a: " + "[" * 20_000 + "]" * 20_000, path=VALIDATE)
    assert r.status_code == 422


def test_invalid_json_reports_line(client: TestClient) -> None:
    r = client.post(VALIDATE, content='{\n"name": "x",\n}', headers={"content-type": "application/json"})
    assert r.status_code == 422
    (err,) = r.json()["errors"]
    assert err["path"] == "<document>" and err["line"] == 3 and err["message"].startswith("invalid JSON")


@pytest.mark.parametrize(
    "doc, path",
    [
        ('{"name": "x", "optimizer": {"eps": NaN}}', "<document>"),
        ('{"name": "x", "description": "a\\u0000b"}', "description"),
        ('{"name": "x", "description": "\\ud800"}', "description"),
    ],
)
def test_values_the_store_cannot_hold_are_422(client: TestClient, doc: str, path: str) -> None:
    r = client.post(VALIDATE, content=doc, headers={"content-type": "application/json"})
    assert r.status_code == 422
    assert r.json()["errors"][0]["path"] == path


def test_non_finite_yaml_float_is_422_naming_the_field(client: TestClient) -> None:
    r = post_yaml(client, YAML_RECIPE + "recovery:\n  min_lr: .inf\n", path=VALIDATE)
    assert r.status_code == 422
    (err,) = r.json()["errors"]
    assert err["path"] == "recovery.min_lr" and "finite number" in err["message"]


def test_not_a_mapping(client: TestClient) -> None:
    r = client.post(VALIDATE, json=[1, 2])
    assert r.status_code == 422
    assert r.json()["errors"][0]["path"] == "<recipe>"


@pytest.mark.parametrize("media", ["text/plain", "application/xml", "multipart/form-data; boundary=x", None])
def test_wrong_content_type_is_415(client: TestClient, media: str | None) -> None:
    headers = {"content-type": media} if media else {}
    r = client.post(VALIDATE, content=YAML_RECIPE.encode(), headers=headers)
    assert r.status_code == 415
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["type"] == "urn:ballast:problem:unsupported-media-type"


def test_oversize_body_is_413_before_parsing(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_recipe_bytes=2048)
    # invalid YAML beyond the limit: a 413 (not a 422) shows the size check came before parsing
    big = "{{{{ not yaml " * 400
    r = client.post(VALIDATE, content=big, headers={"content-type": "application/yaml"})
    assert r.status_code == 413
    assert r.headers["content-type"] == "application/problem+json"
    assert r.json()["status"] == 413


def test_oversize_streamed_body_without_length_is_413(make_client: Callable[..., TestClient]) -> None:
    client = make_client(max_recipe_bytes=2048)

    def chunks() -> Iterator[bytes]:
        for _ in range(10):
            yield b"# padding " * 50

    r = client.post(VALIDATE, content=chunks(), headers={"content-type": "application/yaml"})
    assert r.status_code == 413
    assert r.json()["status"] == 413


def test_recipe_schema_endpoint(client: TestClient) -> None:
    r = client.get("/api/v1/recipes/schema")
    assert r.status_code == 200
    assert r.json()["title"] == "Ballast StabilityRecipe (ballast/v1)"
    assert "optimizer" in r.json()["properties"]


def test_a_mapping_where_a_name_is_expected_is_422_not_500(client: TestClient) -> None:
    # found by schemathesis: `schedule.preset: {}` used to raise TypeError inside the recipe's validator
    r = post_yaml(client, YAML_RECIPE + "schedule:\n  preset: {}\n", path=VALIDATE)
    assert r.status_code == 422
    assert r.json()["errors"][0]["path"] == "schedule.preset"
