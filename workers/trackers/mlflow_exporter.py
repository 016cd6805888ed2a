"""The MLflow writer: one MLflow run per Ballast run, metrics per attempt."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from contracts.export import ExportTargets
from workers.trackers.series import (
    ATTEMPT_START,
    Event,
    anomaly_line,
    checkpoint_line,
    end_line,
    event_step,
    scalars,
    start_line,
)

MLFLOW_BATCH = 1000
"""MLflow's ``log_batch`` limit on metrics per call."""
MLFLOW_TEXT_LINES = 2000
"""Lines kept in an MLflow text artifact (anomalies, checkpoints) of one attempt."""


def _key(name: str) -> str:
    """An MLflow metric/tag/artifact-safe name (alphanumerics, ``_ - . / space``)."""
    return re.sub(r"[^A-Za-z0-9_\-./ ]", "_", name)


class MlflowExporter:
    """One MLflow run per Ballast run through ``MlflowClient`` (needs ``mlflow`` or ``mlflow-skinny``)."""

    name = "mlflow"

    def __init__(self, targets: ExportTargets, *, experiment: str, run_key: str, run_name: str,
                 tags: Mapping[str, str]) -> None:
        from mlflow.entities import Metric, RunTag
        from mlflow.tracking import MlflowClient

        self._metric, self._tag = Metric, RunTag
        self.client = MlflowClient(tracking_uri=targets.mlflow_tracking_uri)
        exp = self.client.get_experiment_by_name(experiment)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            location = None
            if targets.mlflow_artifact_root:
                location = f"{targets.mlflow_artifact_root.rstrip('/')}/{_key(experiment)}"
            exp_id = self.client.create_experiment(experiment, artifact_location=location)
        found = self.client.search_runs([exp_id], f"tags.`ballast.run_key` = '{run_key}'", max_results=1)
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            run = self.client.create_run(exp_id, run_name=run_name, tags={"ballast.run_key": run_key, **tags})
            self.run_id = run.info.run_id
        self._texts: dict[str, list[str]] = {}
        self._tagged: set[str] = set()

    def write(self, events: list[Event]) -> None:
        metrics: list[Any] = []
        tags: dict[str, str] = {}
        dirty: set[str] = set()
        for e in events:
            prefix = f"attempt_{e.attempt}"
            step = event_step(e.data)
            metrics.extend(self._metric(_key(f"{prefix}/{name}"), value, e.ts_ms, step)
                           for name, value in scalars(e.type, e.data).items())
            if e.type == "anomaly":
                self._append(f"{prefix}/anomalies.txt", anomaly_line(e.data), dirty)
                first = f"ballast.{prefix}.first_anomaly"
                if first not in self._tagged:
                    self._tagged.add(first)
                    tags[first] = anomaly_line(e.data)
            elif e.type == "checkpoint":
                self._append(f"{prefix}/checkpoints.txt", checkpoint_line(e.data), dirty)
            elif e.type == "end":
                tags[f"ballast.{prefix}.outcome"] = str(e.data.get("outcome"))
                tags[f"ballast.{prefix}.end"] = end_line(e.data)[:5000]
            elif e.type == ATTEMPT_START:
                tags[f"ballast.{prefix}.start"] = start_line(e.data)
                tags["ballast.attempt"] = str(e.attempt)
        run_tags = [self._tag(k, v) for k, v in tags.items()]
        for i in range(0, max(len(metrics), 1), MLFLOW_BATCH):
            chunk = metrics[i:i + MLFLOW_BATCH]
            if chunk or (i == 0 and run_tags):
                self.client.log_batch(self.run_id, metrics=chunk, tags=run_tags if i == 0 else [])
        for path in sorted(dirty):
            self.client.log_text(self.run_id, "\n".join(self._texts[path]) + "\n", path)

    def _append(self, path: str, line: str, dirty: set[str]) -> None:
        """A line of a text artifact (rewritten whole when it changes: MLflow has no append), up to
        ``MLFLOW_TEXT_LINES`` lines; past that the artifact says how many more there were."""
        lines = self._texts.setdefault(path, [])
        if len(lines) < MLFLOW_TEXT_LINES:
            lines.append(line)
        elif len(lines) == MLFLOW_TEXT_LINES:
            lines.append("... more not kept here (all of them are in Ballast's store)")
        else:
            return
        dirty.add(path)

    def close(self, final: Event | None) -> None:
        """Finish the MLflow run when the last attempt of this worker group succeeded or was cancelled; after a
        divergence or a crash the orchestrator may start another attempt, which continues the same run."""
        outcome = final.data.get("outcome") if final is not None else None
        if outcome == "succeeded":
            self.client.set_terminated(self.run_id, status="FINISHED")
        elif outcome == "cancelled":
            self.client.set_terminated(self.run_id, status="KILLED")
