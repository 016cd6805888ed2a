"""One settings class for the whole service (env prefix ``BALLAST_``)."""

from __future__ import annotations

import json
import os
from enum import StrEnum
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from contracts.export import ExportTargets, export_targets
from contracts.storage import StorageOptions, local_dir


class AuthMode(StrEnum):
    off = "off"
    token = "token"


class Settings(BaseSettings):
    """Service configuration. Every field can be set as ``BALLAST_<NAME>`` in the environment."""

    model_config = SettingsConfigDict(env_prefix="BALLAST_", extra="ignore")

    home: Path = Field(default=Path(".ballast"), description="Directory for local state (SQLite file, checkpoints).")
    database_url: str = Field(
        default="",
        description="SQLAlchemy URL. Empty means a SQLite file `<home>/ballast.db` in WAL mode. "
        "`postgresql://` and `postgres://` are normalised to the psycopg 3 driver.",
    )
    checkpoint_root: str = Field(
        default="",
        description="Where attempts store checkpoints: a local path or a URI such as s3://bucket/prefix. "
        "Empty means `<home>/checkpoints`. On a Ray cluster of several nodes it must be shared by all of them: "
        "an object store, or a path declared shared with BALLAST_CHECKPOINT_ROOT_SHARED.",
    )
    checkpoint_root_shared: bool = Field(
        default=False,
        description="Declares a local-path checkpoint root as storage every Ray node mounts at the same path "
        "(NFS, a ReadWriteMany volume). Without it a local root is refused on a cluster of more than one node.",
    )
    s3_endpoint: str = Field(
        default="",
        description="Endpoint of an S3-compatible store for s3:// checkpoint roots, e.g. `http://minio:9000`. "
        "Empty: AWS, or `AWS_ENDPOINT_URL_S3` where set.",
    )
    s3_region: str = Field(default="", description="Region of the s3:// bucket. Empty: the AWS SDK's default.")
    s3_access_key_id: str = Field(
        default="",
        description="Access key for s3:// checkpoints. Empty: the AWS SDK's credential chain of every process "
        "(`AWS_ACCESS_KEY_ID`, IAM roles). When set, the scheduler passes it with the launch to the workers.",
    )
    s3_secret_access_key: SecretStr | None = Field(
        default=None, description="Secret key that goes with BALLAST_S3_ACCESS_KEY_ID."
    )
    ray_address: str | None = Field(
        default=None,
        description="Address of an existing Ray cluster. Unset: RAY_ADDRESS if set, else a local Ray.",
    )
    ray_num_cpus: int | None = Field(default=None, ge=1, description="CPUs for a local Ray (default: all).")
    max_recipe_bytes: int = Field(
        default=256 * 1024, ge=1024, le=16 * 1024 * 1024, description="Largest recipe document accepted."
    )
    max_concurrent_runs: int = Field(default=2, ge=1, description="Runs the scheduler keeps active at once.")
    scheduler_poll_seconds: float = Field(default=0.5, gt=0, le=60, description="Scheduler claim/drain period.")
    auth_mode: AuthMode = Field(
        default=AuthMode.off, description="`off` (allowed only on a loopback bind) or `token` (bearer API tokens)."
    )
    bind_host: str = Field(default="127.0.0.1", description="Address `ballast serve` binds to.")
    bind_port: int = Field(default=8420, ge=1, le=65535, description="Port `ballast serve` binds to.")
    token_pepper: SecretStr = Field(
        default=SecretStr("ballast-local-pepper"),
        description="Secret mixed into stored token hashes. Must be changed outside local mode.",
    )
    allowed_import_modules: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Module prefixes a recipe may name in `module:function` import strings (empty: none). "
        "Comma-separated (`mylab,team.models`) or a JSON list.",
    )
    telemetry_export_dir: str = Field(
        default="",
        description="Root of the TensorBoard export (`telemetry.export: [tensorboard]`): each run writes "
        "`run-<id>/attempt-<n>/` under it. Empty means `<home>/tensorboard`. Multi-node: a shared filesystem.",
    )
    mlflow_tracking_uri: str = Field(
        default="",
        description="MLflow tracking URI for `telemetry.export: [mlflow]`. Empty: `MLFLOW_TRACKING_URI` if set, "
        "else a SQLite store `<home>/mlflow/mlflow.db`.",
    )
    mlflow_experiment: str = Field(
        default="ballast", description="MLflow experiment of exported runs (a recipe may name another)."
    )
    cluster_autoscales: bool = Field(
        default=False,
        description="A run that needs more CPUs/GPUs than the whole Ray cluster has: `false` fails it at once with "
        "the reason; `true` (an autoscaler can add nodes) leaves it queued with the reason.",
    )
    metrics_every_steps: int = Field(
        default=1, ge=1, description="Downsampling of per-step metrics written to the store (1 = every step)."
    )
    preflight_timeout_seconds: float = Field(
        default=300.0, ge=0, le=3600,
        description="Before a run's first attempt (of a recipe with user code or outside data, unless "
        "BALLAST_PREFLIGHT_BUILTIN_RECIPES), a small Ray task imports its factories, builds rank 0's data "
        "and model and runs one forward, so a recipe that cannot run fails in seconds as `config_error`; this is "
        "how long it may take (including a `code` runtime env's setup) before the attempt starts anyway. 0 turns "
        "the probe off.",
    )
    preflight_builtin_recipes: bool = Field(
        default=False,
        description="Probe a recipe that uses only the built-in models and synthetic data and ships no `code` too. "
        "Off: such a recipe starts its worker group at once (one process spawn and torch import sooner); a setup "
        "error of its own (a model size the engine refuses) is still a `config_error`, found by the workers.",
    )
    ray_preload_modules: list[str] = Field(
        default_factory=lambda: ["torch", "ray.train.torch", "workers.entry"],
        description="Modules a local Ray's worker processes import before they take work (Ray's "
        "`preload_python_modules`): a channel actor or probe that gets one of Ray's prestarted workers starts with "
        "torch loaded. Local Ray only (a cluster's own `ray start` decides there); [] turns it off.",
    )
    standby_worker_groups: int = Field(
        default=0, ge=0, le=16,
        description="Worker groups of the common shape (one worker of `standby_cpus` CPUs, no GPU, no `code`, no "
        "preflight) the scheduler keeps started ahead of demand, everything imported, so such a run's first step "
        "comes within a second of its claim instead of after three cold process starts. Each holds its CPUs while it "
        "waits (they count as free: a run that needs them retires it). 0 turns it off.",
    )
    standby_cpus: float = Field(default=1.0, gt=0, le=512,
                                description="CPUs of a standby worker group's one worker (a run fits it when its "
                                "`resources.cpus_per_worker` is the same).")
    runtime_env: dict[str, Any] = Field(
        default_factory=dict,
        description="The operator's Ray `runtime_env` (JSON) for every worker group and preflight probe; a "
        "recipe's `code` section is merged over it (py_modules and pip appended).",
    )
    allow_runtime_pip: bool = Field(
        default=False,
        description="Whether a recipe's `code.pip` may install packages on the cluster (refused at submit "
        "otherwise).",
    )

    @field_validator("database_url")
    @classmethod
    def _normalise_url(cls, v: str) -> str:
        v = v.strip()
        for prefix in ("postgres://", "postgresql://"):
            if v.startswith(prefix):
                return "postgresql+psycopg://" + v[len(prefix) :]
        return v

    @field_validator("allowed_import_modules", mode="before")
    @classmethod
    def _split_modules(cls, v: Any) -> Any:
        # env values arrive as one string; a plain comma list is what operators type
        if isinstance(v, str):
            text = v.strip()
            if text.startswith("["):
                return json.loads(text)  # a JSONDecodeError is a ValueError: reported as a field error
            return [part.strip() for part in text.split(",") if part.strip()]
        return v

    @model_validator(mode="after")
    def _fill_defaults(self) -> Settings:
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.home / 'ballast.db').as_posix()}"
        if not self.checkpoint_root:
            self.checkpoint_root = str((self.home / "checkpoints").resolve())
        if not self.telemetry_export_dir:
            self.telemetry_export_dir = str((self.home / "tensorboard").resolve())
        if self.ray_address is None:
            self.ray_address = os.environ.get("RAY_ADDRESS") or None
        return self

    def checkpoint_storage(self) -> StorageOptions:
        """How workers and the scheduler reach an object-store checkpoint root (ignored for a local one)."""
        secret = self.s3_secret_access_key.get_secret_value() if self.s3_secret_access_key is not None else ""
        return StorageOptions(endpoint=self.s3_endpoint, access_key_id=self.s3_access_key_id,
                              secret_access_key=secret, region=self.s3_region)

    def checkpoint_root_refusal(self, nodes: int) -> str | None:
        """Why the checkpoint root cannot serve a Ray cluster of ``nodes`` nodes, or None if it can.

        A local path that is not declared shared would hold each checkpoint on the disk of the node that wrote
        it: a resume on another node, the scheduler's verification and retention would not find it."""
        if nodes <= 1 or local_dir(self.checkpoint_root) is None or self.checkpoint_root_shared:
            return None
        return (f"BALLAST_CHECKPOINT_ROOT={self.checkpoint_root} is a local path, but the Ray cluster has {nodes} "
                "nodes: a checkpoint written on one would be missing on the others. Use an object store "
                "(s3://bucket/prefix) or, if the path is storage every node mounts (NFS), set "
                "BALLAST_CHECKPOINT_ROOT_SHARED=true")

    def export_targets(self) -> ExportTargets:
        """Where attempts of this server write their tracker export (sent in each ``AttemptSpec``)."""
        return export_targets(home=self.home, tensorboard_dir=self.telemetry_export_dir,
                              mlflow_tracking_uri=self.mlflow_tracking_uri, mlflow_experiment=self.mlflow_experiment)

    @property
    def is_loopback(self) -> bool:
        return self.bind_host in {"127.0.0.1", "localhost", "::1"}

    def check_serving_safety(self) -> None:
        """Refuse insecure settings outside local mode (a loopback bind)."""
        if self.is_loopback:
            return
        if self.auth_mode is AuthMode.off:
            raise ValueError(
                f"BALLAST_AUTH_MODE=off is only allowed on a loopback bind, not {self.bind_host!r}; "
                "set BALLAST_AUTH_MODE=token"
            )
        if self.token_pepper.get_secret_value() == "ballast-local-pepper":
            raise ValueError("BALLAST_TOKEN_PEPPER must be set to a secret value outside local mode")


def settings_error_lines(exc: ValidationError) -> list[str]:
    """One line per invalid setting, named as the environment variable the operator sets."""
    lines = []
    for err in exc.errors(include_url=False):
        field = str(err["loc"][0]) if err["loc"] else ""
        name = f"BALLAST_{field.upper()}" if field else "settings"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"{name}: {msg}")
    return lines


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
