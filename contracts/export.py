"""Where the tracker export (``telemetry.export``) writes: the server's targets, as an attempt receives them.

The scheduler resolves them from its settings (``BALLAST_TELEMETRY_EXPORT_DIR``, ``BALLAST_MLFLOW_TRACKING_URI``,
``BALLAST_MLFLOW_EXPERIMENT``) and sends them in the ``AttemptSpec``, so a Ray worker on another node writes where
the server says, not where its own environment would. An attempt started without them (``ballast train``,
``run_attempt`` in a library) reads the same variables from its own environment (``from_env``). Both go through
``export_targets``: one rule for the defaults.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

DEFAULT_EXPERIMENT = "ballast"


@dataclass(frozen=True, kw_only=True)
class ExportTargets:
    tensorboard_root: str
    """Absolute directory under which each run's TensorBoard files go (``run-<id>/attempt-<n>/``)."""
    mlflow_tracking_uri: str
    """The MLflow tracking URI (a server, ``sqlite:///...``, or ``file:...``)."""
    mlflow_experiment: str = DEFAULT_EXPERIMENT
    mlflow_artifact_root: str | None = None
    """Where a new experiment keeps its artifacts when the tracking store is local (None: the server decides)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ExportTargets:
        root = data.get("mlflow_artifact_root")
        return cls(tensorboard_root=str(data["tensorboard_root"]),
                   mlflow_tracking_uri=str(data["mlflow_tracking_uri"]),
                   mlflow_experiment=str(data.get("mlflow_experiment") or DEFAULT_EXPERIMENT),
                   mlflow_artifact_root=None if root is None else str(root))

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ExportTargets:
        """The targets from ``BALLAST_*`` variables, as ``orchestrator/settings.py`` reads them."""
        env = os.environ if env is None else env
        return export_targets(home=env.get("BALLAST_HOME") or ".ballast",
                              tensorboard_dir=env.get("BALLAST_TELEMETRY_EXPORT_DIR", ""),
                              mlflow_tracking_uri=env.get("BALLAST_MLFLOW_TRACKING_URI", ""),
                              mlflow_experiment=env.get("BALLAST_MLFLOW_EXPERIMENT", ""),
                              env=env)


def export_targets(*, home: str | Path, tensorboard_dir: str = "", mlflow_tracking_uri: str = "",
                   mlflow_experiment: str = "", env: Mapping[str, str] | None = None) -> ExportTargets:
    """The defaults: TensorBoard under ``<home>/tensorboard``; MLflow at ``MLFLOW_TRACKING_URI`` if set, else a
    SQLite store ``<home>/mlflow/mlflow.db`` with artifacts beside it."""
    env = os.environ if env is None else env
    home_path = Path(home).expanduser().resolve()
    tb_root = str(Path(tensorboard_dir).expanduser().resolve()) if tensorboard_dir else str(home_path / "tensorboard")
    uri = mlflow_tracking_uri or env.get("MLFLOW_TRACKING_URI", "")
    artifacts: str | None = None
    if not uri:
        uri = f"sqlite:///{(home_path / 'mlflow' / 'mlflow.db').as_posix()}"
        artifacts = (home_path / "mlflow" / "artifacts").as_uri()
    elif uri.startswith(("sqlite:", "file:")) or "://" not in uri:
        artifacts = (home_path / "mlflow" / "artifacts").as_uri()
    return ExportTargets(tensorboard_root=tb_root, mlflow_tracking_uri=uri,
                         mlflow_experiment=mlflow_experiment or DEFAULT_EXPERIMENT, mlflow_artifact_root=artifacts)
