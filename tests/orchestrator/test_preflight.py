"""The preflight probe (``workers.preflight.probe``) in this process, and the workers' classification of a setup
error (``workers.entry.report_config_error``): what each says about a recipe that cannot run, and that only
deterministic setup errors count as config errors."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from contracts.recipe import validate_recipe_data
from contracts.wire import AttemptSpec, SetupConfigError
from tests.orchestrator.userpkg import PACKAGE, custom_sections, write_package
from workers.data import SpecError
from workers.entry import report_config_error
from workers.preflight import probe
from workers.sinks import ListSink


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    for name in [m for m in sys.modules if m.startswith(PACKAGE)]:
        del sys.modules[name]


def spec(doc: dict[str, Any], allowed: list[str] | None = None) -> dict[str, Any]:
    allowed = allowed if allowed is not None else [PACKAGE]
    recipe = validate_recipe_data({"name": "p", **doc}, allowed_import_modules=allowed)
    return AttemptSpec(recipe=recipe, checkpoint_dir="/unused", allowed_import_modules=allowed).to_dict()


def test_a_recipe_that_can_run_passes(on_path: None) -> None:
    assert probe(spec(custom_sections()), world_size=2) == {"status": "ok", "error": None}
    assert probe(spec({}))["status"] == "ok"  # the built-in tiny_gpt on markov data


@pytest.mark.parametrize(("doc", "field", "says"), [
    ({"model": {"name": "custom", "factory": "nowhere_pkg.models:make"}}, "model.factory", "cannot import module"),
    (custom_sections("make_not_a_module"), "model.factory", "must return a torch.nn.Module"),
    (custom_sections("make_per_sample_loss"), "loss.name", "not a scalar; add a loss: section"),
    (custom_sections("make_missing"), "model.factory", "has no attribute 'make_missing'"),
    ({**custom_sections(), "distributed": {"freeze_first_n_blocks": 5}}, "distributed.freeze_first_n_blocks",
     "outside [0, 2]"),
], ids=["missing-module", "not-a-module", "non-scalar-loss", "missing-function", "too-many-frozen-blocks"])
def test_a_setup_error_is_a_config_error_naming_the_field(on_path: None, doc: dict[str, Any], field: str,
                                                          says: str) -> None:
    allowed = [PACKAGE, "nowhere_pkg"]
    got = probe(spec(doc, allowed))
    assert got["status"] == "config_error"
    assert got["error"].startswith(f"{field}:") and says in got["error"]


def test_a_module_no_longer_on_the_allow_list_is_a_config_error(on_path: None) -> None:
    raw = spec(custom_sections())
    raw["allowed_import_modules"] = []  # the worker re-checks the list it was sent
    got = probe(raw)
    assert got["status"] == "config_error" and got["error"].startswith("model.factory:")


def test_anything_else_is_inconclusive(monkeypatch: pytest.MonkeyPatch) -> None:
    import workers.preflight as preflight

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise MemoryError("out of memory")

    monkeypatch.setattr(preflight, "build_data", broken)
    got = probe(spec({}))
    assert got == {"status": "inconclusive", "error": "MemoryError: out of memory"}


def test_rank_0_reports_the_config_error_as_its_end_and_every_rank_raises_it() -> None:
    attempt = AttemptSpec.from_dict({**spec({}), "attempt": 3})
    sink = ListSink()
    raised = report_config_error(SpecError("data.factory: must return (inputs, targets)"), attempt, sink)
    assert isinstance(raised, SetupConfigError) and raised.message.startswith("data.factory:")
    ((kind, end),) = [(e["type"], e["data"]) for e in sink.events]
    assert kind == "end" and end["outcome"] == "config_error"
    assert end["reason"] == "data.factory: must return (inputs, targets)"
    assert isinstance(report_config_error(SpecError("x: y"), attempt, None), SetupConfigError)  # other ranks
    import pickle

    assert pickle.loads(pickle.dumps(raised)).message == raised.message  # it crosses Ray's process boundary


def test_an_unmodified_model_with_a_loss_section_passes() -> None:
    """The probe calls the model as the training step does (``Objective``): with a ``loss:`` section an ordinary
    classifier gets ``model(inputs)``, not the whole batch (the README's classifier example)."""
    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples/classifier/recipe.yaml").read_text())
    doc.pop("faults")
    assert probe(spec(doc, ["examples"])) == {"status": "ok", "error": None}
    doc.pop("loss")  # the same model without a loss section cannot return its loss: the field is named
    got = probe(spec(doc, ["examples"]))
    assert got["status"] == "config_error" and "add a loss: section" in got["error"]
