"""The tracker export (``telemetry.export``), read back with the trackers' own readers: TensorBoard's
``EventAccumulator`` over the event files, the MLflow client over a local store. Real training runs with an
injected fault (a NaN loss at step 30, rolled back in place to the step-20 checkpoint), no mocks."""

from __future__ import annotations

import logging
import os
import struct
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from contracts.export import export_targets
from contracts.wire import AttemptOutcome, AttemptSpec
from tests.recipes import build_recipe
from workers.context import WorkerContext
from workers.entry import run_attempt
from workers.sinks import ListSink
from workers.trackers import TrackerExport

pytest.importorskip("tensorboard")  # in [dev]; the extra `ballast[tensorboard]` for users
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

BASE: dict[str, Any] = {
    "name": "tracker-test",
    "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 2, "n_heads": 2, "d_model": 32},
    "data": {"name": "markov", "vocab_size": 32, "seq_len": 16, "branching": 4},
    "training": {"max_steps": 60, "batch_size": 8, "seed": 0},
    "optimizer": {"name": "adamw", "lr": 3e-3},
    "schedule": {"warmup_steps": 10},
    "checkpoint": {"every_steps": 20},
    "telemetry": {"layer_stats_every": 10},
    "success": {"min_progress": 0.0, "early_min_progress": 0.0},
    "faults": [{"type": "nan_loss", "step": 30}],
}
make_recipe = partial(build_recipe, BASE)
RUN_ID = 7
ONSET = 30


class RetryOnce(ListSink):
    """Answers the first rollback with attempt 2 from the step-20 checkpoint (what the scheduler would do)."""

    def __init__(self, resume_from: Path) -> None:
        super().__init__()
        self.resume_from = str(resume_from)
        self.plans = 0

    def request_plan(self, end_data: dict[str, Any]) -> dict[str, Any] | None:
        self.plans += 1
        if self.plans > 1:
            return None
        return {"attempt": 2, "resume_from": self.resume_from, "overrides": {"optimizer.lr": [3e-3, 1.5e-3]},
                "rewarm_steps": 5}

    def by_attempt(self, type: str) -> dict[int, list[dict[str, Any]]]:
        """Events of ``type`` per attempt (an attempt's events end with its ``end``)."""
        out: dict[int, list[dict[str, Any]]] = {1: []}
        attempt = 1
        for e in self.events:
            if e["type"] == type:
                out[attempt].append(e["data"])
            if e["type"] == "end":
                attempt += 1
                out.setdefault(attempt, [])
        return {a: events for a, events in out.items() if events}


def train(tmp_path: Path, export: list[str], *, root: Path | None = None, **spec: Any) -> tuple[AttemptOutcome,
                                                                                                 RetryOnce]:
    recipe = make_recipe(telemetry={"export": export})
    sink = RetryOnce(tmp_path / "ckpt" / "step_00000020")
    targets = export_targets(home=tmp_path / "home", tensorboard_dir=str(root) if root else "",
                             mlflow_tracking_uri=spec.pop("mlflow_tracking_uri", ""))
    res = run_attempt(AttemptSpec(recipe=recipe, checkpoint_dir=str(tmp_path / "ckpt"), run_id=RUN_ID,
                                  export=targets, **spec), sink)
    return res, sink


def f32(x: float) -> float:
    """What a TensorBoard scalar keeps of a float (float32)."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


def accumulator(path: Path) -> EventAccumulator:
    ea = EventAccumulator(str(path), size_guidance={"scalars": 0, "tensors": 0, "histograms": 0})
    ea.Reload()
    return ea


def texts(ea: EventAccumulator, tag: str) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for ev in ea.Tensors(f"{tag}/text_summary"):
        out.setdefault(ev.step, []).extend(v.decode() for v in ev.tensor_proto.string_val)
    return out


def series(ea: EventAccumulator, tag: str) -> list[tuple[int, float]]:
    return [(ev.step, ev.value) for ev in ea.Scalars(tag)]


def expected(events: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(e["step"], f32(e[key])) for e in events if e.get(key) is not None]


# ------------------------------------------------------------------------------------------ TensorBoard
def test_tensorboard_export_reads_back_per_attempt_with_tensorboards_reader(tmp_path: Path) -> None:
    res, sink = train(tmp_path, ["tensorboard"])
    assert [p.outcome for p in res.previous] == ["diverged"] and res.outcome == "succeeded" and res.attempt == 2
    run_dir = tmp_path / "home" / "tensorboard" / f"run-{RUN_ID}"
    assert sorted(p.name for p in run_dir.iterdir()) == ["attempt-1", "attempt-2"]
    metrics, layers = sink.by_attempt("metric"), sink.by_attempt("layer_stats")

    first = accumulator(run_dir / "attempt-1")
    # the loss series is the metric events' losses, step by step; the NaN step (loss None) is left out
    assert series(first, "loss") == expected(metrics[1], "loss")
    assert [s for s, _ in series(first, "loss")] == [s for s in range(ONSET + 1) if s != ONSET]
    for key, tag in (("grad_norm", "grad_norm/pre_clip"), ("grad_norm_clipped", "grad_norm/post_clip"),
                     ("lr", "lr"), ("throughput", "throughput")):
        assert series(first, tag) == expected(metrics[1], key), tag
    # the anomaly is a text event at its onset step
    anomalies = texts(first, "anomalies/nonfinite")
    assert list(anomalies) == [ONSET] and "nonfinite" in anomalies[ONSET][0]
    ended = [t for lines in texts(first, "attempt").values() for t in lines if t.startswith("ended")]
    assert len(ended) == 1 and "ended diverged" in ended[0] and f"onset step {ONSET}" in ended[0]
    checkpoints = texts(first, "checkpoints")
    assert list(checkpoints) == [20] and "healthy" in checkpoints[20][0]
    # per-layer norms: a histogram over the layers and one scalar per layer, on each layer-stats step
    # (the NaN step's norms are all non-finite: nothing to draw)
    hist = first.Histograms("layer_grad_norms")
    finite = [e for e in layers[1] if any(v is not None for v in e["layer_grad_norms"].values())]
    assert [h.step for h in hist] == [e["step"] for e in finite] == [0, 10, 20]
    assert all(h.histogram_value.num == len(layers[1][0]["layer_grad_norms"]) for h in hist)
    name, value = next(iter(layers[1][0]["layer_grad_norms"].items()))
    assert series(first, f"layer_grad_norm/{name}")[0] == (0, f32(value))
    assert [s for s, _ in series(first, "block_grad_norm/00")] == [0, 10, 20]

    # the retry is its own TensorBoard run: it re-runs steps 20.. on its own line, from its resume point
    second = accumulator(run_dir / "attempt-2")
    assert series(second, "loss") == expected(metrics[2], "loss")
    assert series(second, "loss")[0][0] == 20 and series(second, "loss")[-1][0] == 59
    start = texts(second, "attempt")[20]
    assert any("attempt 2 resumed from" in t and "step_00000020" in t for t in start)
    assert "anomalies/nonfinite/text_summary" not in second.Tags()["tensors"]


def test_eval_events_become_a_series_and_unknown_types_are_skipped(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    spec = AttemptSpec(recipe=make_recipe(telemetry={"export": ["tensorboard"]}), checkpoint_dir=str(tmp_path),
                       run_id=3, export=export_targets(home=tmp_path))
    export = TrackerExport.open(spec, WorkerContext())
    assert export is not None
    inner = ListSink()
    sink = export.tee(inner, spec, None)
    with caplog.at_level(logging.WARNING, logger="ballast.trackers"):
        for step in range(3):
            sink.emit("metric", {"step": step, "loss": 2.0 - step / 10, "grad_norm": None, "loss_scale": 2.0 ** 16})
            sink.emit("a_future_event", {"step": step, "whatever": [1, 2]})
        sink.emit("eval", {"step": 2, "eval_loss": 1.25})
        export.close()
    assert [e["type"] for e in inner.events].count("a_future_event") == 3  # the real sink gets everything
    ea = accumulator(tmp_path / "tensorboard" / "run-3" / "attempt-1")
    assert series(ea, "eval_loss") == [(2, 1.25)]
    assert [s for s, _ in series(ea, "loss")] == [0, 1, 2] and "grad_norm/pre_clip" not in ea.Tags()["scalars"]
    assert series(ea, "loss_scale") == [(0, 65536.0), (1, 65536.0), (2, 65536.0)]
    assert caplog.records == []


def test_no_export_unless_the_recipe_asks_and_only_on_rank_zero(tmp_path: Path) -> None:
    plain = AttemptSpec(recipe=make_recipe(), checkpoint_dir=str(tmp_path))
    asks = AttemptSpec(recipe=make_recipe(telemetry={"export": ["tensorboard"]}), checkpoint_dir=str(tmp_path),
                       export=export_targets(home=tmp_path))
    assert TrackerExport.open(plain, WorkerContext()) is None
    assert TrackerExport.open(asks, WorkerContext(rank=1, world_size=2)) is None


# ------------------------------------------------------------------------------------------ failures
def _one_warning(caplog: pytest.LogCaptureFixture) -> str:
    warnings = [r for r in caplog.records if r.name == "ballast.trackers"]
    assert len(warnings) == 1 and warnings[0].levelno == logging.WARNING
    return warnings[0].getMessage()


def test_an_export_dir_that_cannot_be_created_does_not_stop_training(tmp_path: Path,
                                                                     caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the export root should be\n")
    with caplog.at_level(logging.WARNING, logger="ballast.trackers"):
        res, sink = train(tmp_path, ["tensorboard"], root=blocker / "tb")
    assert res.outcome == "succeeded" and res.attempt == 2
    assert len(sink.of_type("metric")) == ONSET + 1 + (60 - 20)  # the real sink saw every step of both attempts
    assert "tensorboard export disabled" in _one_warning(caplog)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a chmod'd directory")
def test_a_read_only_export_dir_does_not_stop_training(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with caplog.at_level(logging.WARNING, logger="ballast.trackers"):
            res, _ = train(tmp_path, ["tensorboard"], root=locked)
    finally:
        locked.chmod(0o700)
    assert res.outcome == "succeeded"
    assert "PermissionError" in _one_warning(caplog)


# ------------------------------------------------------------------------------------------ MLflow
@pytest.mark.parametrize("store", ["sqlite", "file"])
def test_mlflow_export_reads_back_with_the_mlflow_client(tmp_path: Path, store: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("mlflow")  # in [dev]; the extra `ballast[mlflow]` for users
    from mlflow.tracking import MlflowClient

    if store == "file":  # MLflow 3 keeps the file store only on request
        monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
        uri = (tmp_path / "mlruns").as_uri()
    else:
        uri = f"sqlite:///{(tmp_path / 'mlflow.db').as_posix()}"
    res, sink = train(tmp_path, ["mlflow"], mlflow_tracking_uri=uri)
    assert res.outcome == "succeeded" and res.attempt == 2

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("ballast")
    assert exp is not None
    runs = client.search_runs([exp.experiment_id], f"tags.`ballast.run_id` = '{RUN_ID}'")
    assert len(runs) == 1, "one MLflow run per Ballast run"
    run = runs[0]
    assert run.info.run_name == f"ballast-run-{RUN_ID}" and run.info.status == "FINISHED"
    metrics = sink.by_attempt("metric")
    for attempt in (1, 2):
        history = sorted(client.get_metric_history(run.info.run_id, f"attempt_{attempt}/loss"), key=lambda m: m.step)
        assert [(m.step, m.value) for m in history] == [(e["step"], e["loss"]) for e in metrics[attempt]
                                                         if e["loss"] is not None]
    assert client.get_metric_history(run.info.run_id, "attempt_2/loss")[0].step == 20
    lr = client.get_metric_history(run.info.run_id, "attempt_1/lr")
    assert len(lr) == ONSET + 1
    assert client.get_metric_history(run.info.run_id, "attempt_1/update_ratio")
    tags = run.data.tags
    assert tags["ballast.attempt_1.outcome"] == "diverged" and tags["ballast.attempt_2.outcome"] == "succeeded"
    assert tags["ballast.attempt_1.first_anomaly"].startswith(f"step {ONSET}: nonfinite")
    assert "resumed from" in tags["ballast.attempt_2.start"]
    local = Path(client.download_artifacts(run.info.run_id, "attempt_1/anomalies.txt", str(tmp_path / "dl")))
    assert local.read_text().startswith(f"step {ONSET}: nonfinite")

    if store == "sqlite":
        # a later worker group of the same Ballast run (a restart after a crash) continues the same MLflow run
        res3, _ = train(tmp_path / "third", ["mlflow"], mlflow_tracking_uri=uri, attempt=3,
                        resume_from=str(tmp_path / "ckpt" / "step_00000040"))
        assert res3.outcome == "succeeded"
        runs = client.search_runs([exp.experiment_id], f"tags.`ballast.run_id` = '{RUN_ID}'")
        assert len(runs) == 1
        steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "attempt_3/loss")]
        assert sorted(steps) == list(range(40, 60))


# ------------------------------------------------------------------------------------------ Ray Train
@pytest.mark.ray
@pytest.mark.timeout(300)
def test_on_ray_train_rank_zero_writes_to_the_servers_export_root(ray_cluster: Any, tmp_path: Path) -> None:
    from tests.workers.test_engine_ray import RECIPE, _fit

    recipe = build_recipe(RECIPE, training={"max_steps": 20}, faults=[], telemetry={"export": ["tensorboard"]})
    spec = AttemptSpec(recipe=recipe, checkpoint_dir=str(tmp_path / "scratch"), run_id=11,
                       export=export_targets(home=tmp_path / "server-home"))
    events = _fit(tmp_path, "tracked", spec)
    run_dir = tmp_path / "server-home" / "tensorboard" / "run-11"
    assert [p.name for p in run_dir.iterdir()] == ["attempt-1"]
    files = list((run_dir / "attempt-1").iterdir())
    assert len(files) == 1, "one writer: rank 0's"
    metrics = [e["data"] for e in events if e["type"] == "metric"]
    assert series(accumulator(run_dir / "attempt-1"), "loss") == expected(metrics, "loss") and len(metrics) == 20
