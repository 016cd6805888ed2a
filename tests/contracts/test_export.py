"""The tracker export's contract: the recipe's ``telemetry.export`` section, the server's targets and their one
rule for defaults, and the targets' trip through the ``AttemptSpec``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contracts.export import ExportTargets, export_targets
from contracts.recipe import Exporter, RecipeError
from contracts.wire import AttemptSpec
from orchestrator.settings import Settings
from tests.recipes import build_recipe


def test_the_recipe_names_exporters_and_a_subdirectory_inside_the_root() -> None:
    telemetry = build_recipe(telemetry={"export": ["tensorboard", "mlflow"], "export_dir": "team/exp1",
                                        "mlflow_experiment": "lm"}).telemetry
    assert telemetry.export == [Exporter.tensorboard, Exporter.mlflow] and telemetry.export_dir == "team/exp1"
    assert build_recipe().telemetry.export == []


@pytest.mark.parametrize(("telemetry", "message"), [
    ({"export": ["wandb"]}, "telemetry.export.0"),
    ({"export": ["tensorboard", "tensorboard"]}, "named once"),
    ({"export_dir": "/etc/cron.d"}, "relative path inside the export root"),
    ({"export_dir": "a/../../b"}, "relative path inside the export root"),
    ({"export_dir": "s3://bucket"}, "relative path inside the export root"),
])
def test_bad_telemetry_export_is_refused_naming_the_field(telemetry: dict[str, object], message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        build_recipe(telemetry=telemetry)


def test_defaults_live_under_home_and_follow_mlflow_tracking_uri(tmp_path: Path) -> None:
    t = export_targets(home=tmp_path, env={})
    assert t.tensorboard_root == str(tmp_path / "tensorboard")
    assert t.mlflow_tracking_uri == f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    assert t.mlflow_artifact_root == (tmp_path / "mlflow" / "artifacts").as_uri() and t.mlflow_experiment == "ballast"
    remote = export_targets(home=tmp_path, env={"MLFLOW_TRACKING_URI": "http://mlflow:5000"})
    assert remote.mlflow_tracking_uri == "http://mlflow:5000" and remote.mlflow_artifact_root is None
    env = {"BALLAST_HOME": str(tmp_path), "BALLAST_TELEMETRY_EXPORT_DIR": str(tmp_path / "tb"),
           "BALLAST_MLFLOW_TRACKING_URI": "http://mlflow:5000", "BALLAST_MLFLOW_EXPERIMENT": "lm"}
    from_env = ExportTargets.from_env(env)
    assert (from_env.tensorboard_root, from_env.mlflow_tracking_uri, from_env.mlflow_experiment) == (
        str(tmp_path / "tb"), "http://mlflow:5000", "lm")


def test_the_server_settings_resolve_the_same_targets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    settings = Settings(home=tmp_path, mlflow_experiment="lm")
    assert settings.telemetry_export_dir == str(tmp_path / "tensorboard")
    assert settings.export_targets() == export_targets(home=tmp_path, mlflow_experiment="lm", env={})


def test_targets_travel_in_the_attempt_spec(tmp_path: Path) -> None:
    spec = AttemptSpec(recipe=build_recipe(telemetry={"export": ["mlflow"]}), checkpoint_dir=str(tmp_path),
                       run_id=3, export=export_targets(home=tmp_path, env={}))
    back = AttemptSpec.from_dict(json.loads(json.dumps(spec.to_dict())))
    assert back == spec and back.export == spec.export
    assert AttemptSpec.from_dict({**spec.to_dict(), "export": None}).export is None
