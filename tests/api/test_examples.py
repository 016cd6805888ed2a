"""The README's "your own model" examples, run as a user runs them: `ballast train examples/.../recipe.yaml`.

Each example is unmodified user code (an ordinary classifier on a ``TensorDataset`` with a cross-entropy loss
section; a from-scratch Hugging Face GPT-2 on a local token file). Each recipe injects a fault in attempt 1; the
detectors find it from the numbers, and the local loop (the service's recovery policy, in this process) resumes
from a healthy checkpoint at or before the onset and finishes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

import api.cli  # noqa: F401  (registers the commands)
from api.cli.app import app
from orchestrator.settings import get_settings

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # whole (small) training runs in this process
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def allow_examples(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The operator's allow-list names the examples package, as the examples' comments tell a user to."""
    monkeypatch.setenv("BALLAST_ALLOWED_IMPORT_MODULES", "examples")
    monkeypatch.syspath_prepend(str(REPO))
    get_settings.cache_clear()
    yield
    get_settings.cache_clear()


def train(recipe: Path, ckpt: Path) -> dict[str, Any]:
    res = CliRunner().invoke(app, ["train", str(recipe), "--checkpoint-dir", str(ckpt), "--json"])
    assert res.exit_code == 0, res.output
    out: dict[str, Any] = json.loads(res.stdout)
    return out


def assert_recovered(out: dict[str, Any]) -> None:
    first, last = out["attempts"][0], out["attempts"][-1]
    assert out["outcome"] == "succeeded" and len(out["attempts"]) >= 2
    assert first["outcome"] == "diverged" and first["onset_step"] is not None
    resumed = out["attempts"][1]["resumed_from"]
    assert resumed is not None and resumed["step"] <= first["onset_step"]
    assert last["outcome"] == "succeeded"


def test_the_classifier_example_recovers_through_ballast_train(allow_examples: None, tmp_path: Path) -> None:
    out = train(REPO / "examples/classifier/recipe.yaml", tmp_path / "ckpt")
    assert_recovered(out)
    assert out["attempts"][0]["onset_step"] >= 60  # the fault's step: nothing fired before it


def test_the_gpt2_example_recovers_through_ballast_train(allow_examples: None, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    from examples.hf_gpt2.data import write_tokens  # what `python -m examples.hf_gpt2.data` writes

    tokens = write_tokens(tmp_path / "tokens.npy")
    doc = yaml.safe_load((REPO / "examples/hf_gpt2/recipe.yaml").read_text())
    doc["data"]["path"] = str(tokens)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(doc, sort_keys=False))
    out = train(recipe, tmp_path / "ckpt")
    assert_recovered(out)
    assert out["attempts"][0]["detector"] == "nonfinite" and out["attempts"][0]["onset_step"] == 40
