"""`ballast export RUN DIR` and ``Client.export``: a small built-in recipe is trained to completion by the local
train loop, its events are ingested into the store as the scheduler would, and the weights exported through
the API in each format load with ``strict=True`` into a fresh model, equal to the checkpoint's."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch
import yaml
from safetensors.torch import load_file, load_model
from sqlalchemy.orm import Session, sessionmaker
from torch import nn
from typer.testing import CliRunner

import api.cli  # noqa: F401  (registers the commands)
from api.cli.app import app
from api.cli.local_run import LocalRun
from api.cli.train_cmd import run_in_process
from ballast import Client
from ballast.export import ExportError, clean_state_dict, export_checkpoint, own_module
from contracts.recipe import Recipe, load_recipe
from orchestrator.store.ingest import ingest_events
from orchestrator.store.models import Attempt, Run
from tests.api.conftest import seed_attempt
from workers.checkpoint import load_checkpoint
from workers.data import build_data
from workers.models import build_model
from workers.sinks import ListSink

TINY = {
    "apiVersion": "ballast/v1", "kind": "StabilityRecipe", "name": "tiny",
    "model": {"name": "tiny_gpt", "n_layers": 1, "d_model": 32},
    "data": {"name": "markov"},
    "training": {"max_steps": 40, "batch_size": 8, "seed": 0},
    "optimizer": {"name": "adamw", "lr": 0.01},
    "schedule": {"warmup_steps": 2},
    "checkpoint": {"every_steps": 20},
}
TEXT = yaml.safe_dump(TINY, sort_keys=False)


@dataclass(frozen=True)
class Trained:
    recipe: Recipe
    events: list[dict[str, Any]]
    """Attempt 1's events as the channel delivers them (seq, type, data)."""

    def checkpoint(self, step: int) -> Path:
        return Path(next(e["data"]["uri"] for e in self.events if e["type"] == "checkpoint"
                         and e["data"]["step"] == step))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    recipe = load_recipe(TEXT)
    sinks: list[ListSink] = []

    def make_sink(spec: Any, start: int) -> ListSink:
        sinks.append(ListSink())
        return sinks[-1]

    outcome = LocalRun(recipe, tmp_path_factory.mktemp("trained"), run_in_process, make_sink=make_sink).run()
    assert outcome.outcome == "succeeded" and len(sinks) == 1
    return Trained(recipe, sinks[0].events)


@pytest.fixture
def served(url: str, session_factory: sessionmaker[Session], trained: Trained) -> Callable[..., int]:  # noqa: F811
    """``served(events=None)`` → a succeeded run in the store whose attempt 1 reported ``events``."""

    def make(events: list[dict[str, Any]] | None = None) -> int:
        with Client(url) as client:
            run_id = int(client.submit(TEXT)["id"])
        seed_attempt(session_factory, run_id, 1, state="succeeded")
        with session_factory() as session:
            run = session.get(Run, run_id)
            attempt = session.scalars(sa.select(Attempt).where(Attempt.run_id == run_id)).one()
            assert run is not None
            ingest_events(session=session, run=run, attempt=attempt, events=events or trained.events)
            run.state = "succeeded"
            session.commit()
        return run_id

    return make


def export(*args: str | Path) -> Any:
    return CliRunner().invoke(app, ["export", *(str(a) for a in args)])


def fresh(recipe: Recipe) -> nn.Module:
    """The recipe's model, initialised from another seed (so equality below is the export's doing)."""
    data = build_data(recipe.data, seed=0, batch_size=recipe.training.batch_size)
    return build_model(recipe.model, data, seed=12345)


def saved_weights(path: Path) -> dict[str, torch.Tensor]:
    state, _ = load_checkpoint(path, keys=["model"])
    return dict(state["model"])


def assert_equal_weights(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    got = model.state_dict()
    assert set(got) == set(expected)
    for key, tensor in expected.items():
        assert torch.equal(got[key], tensor), key


def test_state_dict_export_of_the_latest_healthy_checkpoint(
    url: str, served: Callable[..., int], trained: Trained, tmp_path: Path  # noqa: F811
) -> None:
    run_id = served()
    res = export(run_id, tmp_path / "out", "--url", url, "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    ckpt = trained.checkpoint(40)
    with Client(url) as client:
        row = next(c for c in client.checkpoints(run_id) if c["step"] == 40)
    assert doc["run"]["id"] == run_id and doc["format"] == "state_dict"
    assert doc["checkpoint"] == {"id": row["id"], "attempt": 1, "uri": str(ckpt), "healthy": True, "step": 40,
                                 "sha256": row["sha256"]}
    assert doc["model"]["name"] == "tiny_gpt" and doc["dropped_keys"] == []
    assert json.loads((tmp_path / "out" / "export.json").read_text()) == doc
    assert sorted(doc["files"]) == ["model.pt"]

    weights = torch.load(tmp_path / "out" / "model.pt", weights_only=True)
    model = fresh(trained.recipe)
    model.load_state_dict(weights, strict=True)
    assert_equal_weights(model, saved_weights(ckpt))

    text = export(run_id, tmp_path / "again", "--url", url)
    assert text.exit_code == 0, text.output
    assert text.stdout.startswith(f"run {run_id}: checkpoint {row['id']} (attempt 1, step 40, healthy) exported")


def test_safetensors_export_through_the_sdk_and_by_step(
    url: str, served: Callable[..., int], trained: Trained, tmp_path: Path  # noqa: F811
) -> None:
    run_id = served()
    with Client(url) as client:
        doc = client.export(run_id, tmp_path / "st", format="safetensors", step=20)
    assert doc["checkpoint"]["step"] == 20 and sorted(doc["files"]) == ["model.safetensors"]
    model = fresh(trained.recipe)
    model.load_state_dict(load_file(tmp_path / "st" / "model.safetensors"), strict=True)
    assert_equal_weights(model, saved_weights(trained.checkpoint(20)))
    other = fresh(trained.recipe)
    missing, unexpected = load_model(other, tmp_path / "st" / "model.safetensors", strict=True)
    assert not missing and not unexpected


def test_choosing_by_id_and_the_refusals(
    url: str, served: Callable[..., int], trained: Trained, tmp_path: Path  # noqa: F811
) -> None:
    run_id = served()
    with Client(url) as client:
        first = next(c for c in client.checkpoints(run_id) if c["step"] == 20)
    res = export(run_id, tmp_path / "by-id", "--url", url, "--checkpoint", str(first["id"]), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["checkpoint"]["step"] == 20

    res = export(run_id, tmp_path / "x", "--url", url, "--checkpoint", str(first["id"]), "--step", "20")
    assert res.exit_code == 2 and "not both" in res.stderr
    res = export(run_id, tmp_path / "x", "--url", url, "--step", "15")
    assert res.exit_code == 2 and "no checkpoint there (it has steps [20, 40])" in res.stderr
    res = export(run_id, tmp_path / "x", "--url", url, "--checkpoint", "999")
    assert res.exit_code == 2 and "not a checkpoint of this run" in res.stderr
    res = export(run_id, tmp_path / "hf", "--url", url, "--format", "hf")
    assert res.exit_code == 2 and "is not a Hugging Face model" in res.stderr
    assert not (tmp_path / "hf").exists()  # refused before anything was written
    res = export(999, tmp_path / "x", "--url", url)
    assert res.exit_code == 2 and "404" in res.stderr


def test_a_damaged_checkpoint_is_refused(
    url: str, served: Callable[..., int], trained: Trained, tmp_path: Path  # noqa: F811
) -> None:
    copy = tmp_path / "copy" / "step_00000040"
    shutil.copytree(trained.checkpoint(40), copy)
    blob = bytearray((copy / "model.pt").read_bytes())
    blob[len(blob) // 2] ^= 0xFF
    (copy / "model.pt").write_bytes(bytes(blob))
    events = [
        {**e, "data": {**e["data"], "uri": str(copy)}} if e["type"] == "checkpoint" and e["data"]["step"] == 40
        else e
        for e in trained.events
    ]
    run_id = served(events)
    res = export(run_id, tmp_path / "out", "--url", url)
    assert res.exit_code == 2, res.output
    assert "corrupt checkpoint" in res.stderr and "model.pt sha256 mismatch" in res.stderr
    assert not (tmp_path / "out" / "model.pt").exists()


# ------------------------------------------------------------------------------------------- key cleaning
class _User(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(4, 3)
        self.proj = nn.Linear(3, 3)
        self.out = nn.Linear(3, 4, bias=False)
        self.out.weight = self.embed.weight  # tied: the user's own model expects both names


class _Adapter(nn.Module):
    """A wrapper that holds the user's module as ``module`` and registers its layers again as ``blocks``."""

    def __init__(self, user: nn.Module) -> None:
        super().__init__()
        self.module = user
        self.blocks = nn.ModuleList([user.proj])


def test_cleaning_strips_the_wrapper_prefix_and_drops_aliases() -> None:
    user = _User()
    state = _Adapter(user).state_dict()
    assert "module.proj.weight" in state and "blocks.0.weight" in state
    clean, dropped = clean_state_dict(state, expected=_User().state_dict().keys())
    assert sorted(clean) == sorted(user.state_dict()) and sorted(dropped) == ["blocks.0.bias", "blocks.0.weight"]
    target = _User()
    target.load_state_dict(clean, strict=True)
    assert_equal_weights(target, user.state_dict())
    # without a model to ask, the first name of each alias group is kept
    first, dropped = clean_state_dict(user.state_dict())
    assert "out.weight" not in first and dropped == ["out.weight"]
    assert own_module(_Adapter(user)) is user

    with pytest.raises(ExportError, match="different tensors under one name"):
        clean_state_dict({"module.w": torch.zeros(2), "w": torch.ones(2)})


def test_an_unknown_format_is_refused(trained: Trained, tmp_path: Path) -> None:
    with pytest.raises(ExportError, match="is not one of state_dict, safetensors, hf"):
        export_checkpoint(trained.checkpoint(40), trained.recipe, tmp_path, format="onnx")


# ------------------------------------------------------------------------------------- a Hugging Face model
HF_MODULE = "tests.api.hf_like"


@pytest.fixture(scope="module")
def hf_trained(tmp_path_factory: pytest.TempPathFactory) -> Trained:
    # its tied N(0, 1) embeddings start the loss near 18 nats, and 40 steps leave it above what predicting the
    # token frequencies scores: never learned, by the verdict; this test is about the export, not the learning
    doc = {**TINY, "name": "hf-like", "model": {"name": "custom", "factory": f"{HF_MODULE}:build",
                                                "params": {"vocab_size": 64, "d_model": 16}},
           "success": {"min_progress": 0.0, "early_min_progress": 0.0}}
    recipe = load_recipe(yaml.safe_dump(doc), allowed_import_modules=[HF_MODULE])
    sinks: list[ListSink] = []

    def make_sink(spec: Any, start: int) -> ListSink:
        sinks.append(ListSink())
        return sinks[-1]

    outcome = LocalRun(recipe, tmp_path_factory.mktemp("hf"), run_in_process, make_sink=make_sink,
                       allowed_import_modules=[HF_MODULE]).run()
    assert outcome.outcome == "succeeded", outcome.to_dict()["reason"]
    return Trained(recipe, sinks[-1].events)


def test_hf_and_tied_weights(hf_trained: Trained, tmp_path: Path) -> None:
    from tests.api.hf_like import build

    ckpt = hf_trained.checkpoint(40)
    saved = saved_weights(ckpt)
    assert saved["lm_head.weight"].data_ptr() == saved["embed.weight"].data_ptr()  # tied in the checkpoint too

    doc = export_checkpoint(ckpt, hf_trained.recipe, tmp_path / "hf", format="hf", allowed_import_modules=[HF_MODULE])
    assert sorted(doc["files"]) == ["config.json", "model.safetensors"] and doc["model"]["name"] == "custom"
    model = build()
    missing, unexpected = load_model(model, tmp_path / "hf" / "model.safetensors", strict=True)
    assert not missing and not unexpected
    assert_equal_weights(model, saved)

    # the model expects both tied names, so a state_dict export keeps both (one storage) and loads strictly
    export_checkpoint(ckpt, hf_trained.recipe, tmp_path / "sd", allowed_import_modules=[HF_MODULE])
    weights = torch.load(tmp_path / "sd" / "model.pt", weights_only=True)
    model = build()
    model.load_state_dict(weights, strict=True)
    assert_equal_weights(model, saved)

    with pytest.raises(ExportError, match="cannot rebuild the run's model here"):
        export_checkpoint(ckpt, hf_trained.recipe, tmp_path / "no", format="safetensors")


# -------------------------------------------------------------------------------- a local `ballast train` run
def test_export_from_a_local_train_directory(tmp_path: Path) -> None:
    from tests.api.test_train_loop import spiky, write

    recipe_file = write(tmp_path, spiky())  # diverges in attempt 1, recovers in attempt 2
    trained = CliRunner().invoke(app, ["train", str(recipe_file), "--checkpoint-dir", str(tmp_path / "ckpt"),
                                       "--json"])
    assert trained.exit_code == 0, trained.output
    last = json.loads(trained.stdout)["attempts"][-1]
    newest = max((c for c in last["checkpoints"] if c["healthy"]), key=lambda c: c["step"])

    res = export(tmp_path / "ckpt", tmp_path / "out", "--recipe", recipe_file, "--format", "safetensors", "--json")
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["checkpoint"]["source"] == newest["uri"] and doc["checkpoint"]["step"] == newest["step"] == 60
    recipe = load_recipe(recipe_file.read_text())
    model = fresh(recipe)
    model.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"), strict=True)
    assert_equal_weights(model, saved_weights(Path(newest["uri"])))

    first = json.loads(trained.stdout)["attempts"][0]
    step = min(c["step"] for c in first["checkpoints"] if c["valid"])
    res = export(tmp_path / "ckpt", tmp_path / "early", "--recipe", recipe_file, "--step", str(step))
    assert res.exit_code == 0, res.output
    assert res.stdout.startswith(str(tmp_path / "ckpt" / "attempt-1" / f"step_{step:08d}"))

    res = export(tmp_path / "ckpt", tmp_path / "x")
    assert res.exit_code == 2 and "--recipe" in res.stderr
    res = export(tmp_path / "nowhere", tmp_path / "x", "--recipe", recipe_file)
    assert res.exit_code == 2 and "not a run id, nor a checkpoint directory" in res.stderr
    res = export(tmp_path / "ckpt", tmp_path / "x", "--recipe", recipe_file, "--step", "7")
    assert res.exit_code == 2 and "step 7: no checkpoint there" in res.stderr


# ----------------------------------------------------------------------------- the README's own-model examples
REPO = Path(__file__).resolve().parents[2]


def _train_example(recipe: Recipe, root: Path) -> Path:
    """Train ``recipe`` with the local loop (its fault left out) and return its newest healthy checkpoint."""
    sinks: list[ListSink] = []

    def make_sink(spec: Any, start: int) -> ListSink:
        sinks.append(ListSink())
        return sinks[-1]

    outcome = LocalRun(recipe, root, run_in_process, make_sink=make_sink, allowed_import_modules=["examples"]).run()
    assert outcome.outcome == "succeeded", outcome.to_dict()["reason"]
    return Path([e["data"]["uri"] for e in sinks[-1].events if e["type"] == "checkpoint" and e["data"]["healthy"]][-1])


def test_the_unmodified_classifier_exports_into_a_fresh_classifier(tmp_path: Path) -> None:
    from examples.classifier.model import Classifier

    doc = yaml.safe_load((REPO / "examples/classifier/recipe.yaml").read_text())
    doc.pop("faults")
    doc["training"]["max_steps"] = 30
    recipe = load_recipe(yaml.safe_dump(doc), allowed_import_modules=["examples"])
    ckpt = _train_example(recipe, tmp_path / "trained")
    for fmt, name in (("state_dict", "model.pt"), ("safetensors", "model.safetensors")):
        export_checkpoint(ckpt, recipe, tmp_path / fmt, format=fmt, allowed_import_modules=["examples"])
        model = Classifier(**doc["model"]["params"])  # the user's own class, no Ballast in between
        if fmt == "state_dict":
            model.load_state_dict(torch.load(tmp_path / fmt / name, weights_only=True), strict=True)
        else:
            missing, unexpected = load_model(model, tmp_path / fmt / name, strict=True)
            assert not missing and not unexpected
        assert_equal_weights(model, saved_weights(ckpt))


def test_a_hugging_face_gpt2_exports_with_save_pretrained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from examples.hf_gpt2.data import write_tokens

    doc = yaml.safe_load((REPO / "examples/hf_gpt2/recipe.yaml").read_text())
    doc.pop("faults")
    doc["training"]["max_steps"] = 30
    doc["success"] = {"min_progress": 0.0, "early_min_progress": 0.0}  # 30 steps: the export, not the learning
    doc["data"]["path"] = str(write_tokens(tmp_path / "tokens.npy"))
    recipe = load_recipe(yaml.safe_dump(doc))
    ckpt = _train_example(recipe, tmp_path / "trained")
    export_checkpoint(ckpt, recipe, tmp_path / "hf", format="hf")
    model = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert_equal_weights(model, saved_weights(ckpt))
