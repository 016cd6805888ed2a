"""The scheduler sends its tracker-export targets (``BALLAST_TELEMETRY_EXPORT_DIR``, ``BALLAST_MLFLOW_*``) in the
attempt spec of a recipe that asks for an export, so a Ray worker writes where the server says."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from contracts.export import ExportTargets
from contracts.wire import AttemptSpec
from tests.orchestrator.fakes import FakeLauncher, recipe_doc, submit


def test_a_recipe_that_exports_gets_the_servers_targets_in_its_spec(
    session_factory: sessionmaker[Session], make_scheduler: Any, launcher: FakeLauncher, tmp_path: Path
) -> None:
    plain = submit(session_factory)
    tracked = submit(session_factory, recipe_doc(telemetry={"export": ["tensorboard", "mlflow"]}))
    make_scheduler(telemetry_export_dir=str(tmp_path / "tb"), mlflow_tracking_uri="http://mlflow:5000",
                   mlflow_experiment="lm").tick()
    specs = {c.run_id: AttemptSpec.from_dict(c.launch["spec"]) for c in launcher.launches}
    assert specs[plain].export is None
    assert specs[tracked].export == ExportTargets(tensorboard_root=str(tmp_path / "tb"),
                                                  mlflow_tracking_uri="http://mlflow:5000", mlflow_experiment="lm")
