"""`ballast train RECIPE.yaml`: run one recipe locally, without the service, with a live progress line.

One attempt in this process (world size 1), or with ``--workers N`` a local Ray Train run of N CPU workers.
Exit codes: 0 succeeded, 1 diverged, 2 bad recipe, setting or checkpoint, 3 crashed (an injected crash fault),
130 cancelled (Ctrl-C). A kill_worker fault SIGKILLs this process, as it would a worker.
"""

from __future__ import annotations

import json
import shutil
import signal
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from api.cli.app import app, fail
from api.cli.render import number
from contracts.recipe import Recipe, RecipeError, load_recipe
from orchestrator.settings import get_settings
from workers.sinks import ListSink

EXIT_CODES = {"succeeded": 0, "diverged": 1, "cancelled": 130}
EXIT_CRASHED = 3
"""An injected crash (corrupt_checkpoint fault): the attempt died the way a worker would."""


def _fmt(x: Any, spec: str = ".4g") -> str:
    return number(x, spec, missing="—")


class ProgressSink(ListSink):
    """A ``ListSink`` that also drives a rich progress line (step, loss, grad norm, lr, loss scale, anomalies);
    anomalies and checkpoints are printed above it as they happen."""

    def __init__(self, progress: Progress | None, max_steps: int, start_step: int = 0) -> None:
        super().__init__()
        self.progress = progress
        self.anomalies = 0
        self._task = progress.add_task("starting", total=max_steps, completed=start_step) if progress else None

    def emit(self, type: str, data: dict[str, Any]) -> None:
        super().emit(type, data)
        if self.progress is None or self._task is None:
            return
        if type == "metric":
            desc = (f"loss {_fmt(data.get('loss'))}  gn {_fmt(data.get('grad_norm'), '.3g')}  "
                    f"lr {_fmt(data.get('lr'), '.2e')}  scale {_fmt(data.get('loss_scale'), '.3g')}  "
                    f"anomalies {self.anomalies}{'  skipped' if data.get('skipped') else ''}")
            self.progress.update(self._task, completed=int(data["step"]) + 1, description=desc)
        elif type == "anomaly":
            self.anomalies += 1
            self.progress.console.print(
                f"[yellow]anomaly[/] step {data['step']}: {data['kind']} ({data['detector']}) "
                f"value {_fmt(data.get('value'))} threshold {_fmt(data.get('threshold'))} → {data['action']}"
            )
        elif type == "checkpoint":
            state = "[green]healthy[/]" if data["healthy"] else "[red]unhealthy[/]"
            self.progress.console.print(f"checkpoint step {data['step']} {state}: {data['uri']}")
        elif type == "eval":
            self.progress.console.print(f"eval step {data['step']}: eval loss {_fmt(data.get('eval_loss'))}")


@contextmanager
def _stop_on_sigint(sink: ProgressSink) -> Iterator[None]:
    """First Ctrl-C asks the loop to stop after the current step; a second one interrupts at once."""
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: FrameType | None) -> None:
        if sink.stop_requested:
            raise KeyboardInterrupt
        sink.stop_requested = True

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, previous)


def _load(path: Path, steps: int | None, workers: int | None) -> Recipe:
    from contracts.overrides import apply_overrides

    settings = get_settings()
    try:
        text = path.read_bytes()
    except OSError as exc:
        raise fail(f"{path}: {exc.strerror}") from None
    try:
        recipe = load_recipe(text, max_bytes=settings.max_recipe_bytes,
                             allowed_import_modules=settings.allowed_import_modules)
        overrides: dict[str, Any] = {}
        if steps is not None:
            overrides["training.max_steps"] = [recipe.training.max_steps, steps]
        if workers is not None:
            overrides["resources.num_workers"] = [recipe.resources.num_workers, workers]
        return apply_overrides(recipe, overrides, allowed_import_modules=settings.allowed_import_modules)
    except RecipeError as exc:
        raise fail("; ".join(f"{path}: {e}" for e in exc.errors)) from None


def _summary(console: Console, result: dict[str, Any], elapsed: float, kept_dir: str | None) -> None:
    console.print(
        f"[bold]{result['outcome']}[/] after {result['final_step']} steps in {elapsed:.1f}s"
        + (f" (onset step {result['onset_step']}: {result['detector']})" if result.get("onset_step") is not None
           else "")
    )
    losses = [x for x in result.get("losses", []) if x is not None]
    if losses:
        console.print(f"loss: first {losses[0]:.4g}, last {losses[-1]:.4g}, best {min(losses):.4g}")
    evals = [e["eval_loss"] for e in result.get("evals", []) if e.get("eval_loss") is not None]
    if evals:
        console.print(f"eval loss: first {evals[0]:.4g}, last {evals[-1]:.4g}, best {min(evals):.4g}")
    if result.get("reason"):
        console.print(f"reason: {result['reason']}")
    kinds: dict[str, int] = {}
    for f in result.get("findings", []):
        kinds[f["kind"]] = kinds.get(f["kind"], 0) + 1
    console.print("anomalies: " + (", ".join(f"{k} ×{n}" for k, n in sorted(kinds.items())) or "none"))
    skipped = result.get("skipped_steps", [])
    if skipped:
        console.print(f"skipped updates: {len(skipped)}")
    ckpts = result.get("checkpoints", [])
    if ckpts:
        healthy = [c for c in ckpts if c["healthy"]]
        console.print(f"checkpoints: {len(ckpts)} written, {len(healthy)} healthy"
                      + (f", newest healthy step {healthy[-1]['step']}" if healthy else ""))
    if kept_dir:
        console.print(f"checkpoint dir: {kept_dir}")


@app.command("train")
def train(
    recipe_file: Path = typer.Argument(..., help="Recipe YAML file."),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Override training.max_steps."),
    checkpoint_dir: Path | None = typer.Option(
        None, "--checkpoint-dir", help="Keep checkpoints here (default: a temporary directory, removed after)."
    ),
    resume: Path | None = typer.Option(None, "--resume", help="Resume from this checkpoint directory."),
    workers: int | None = typer.Option(
        None, "--workers", min=1, help="Data-parallel workers; more than 1 runs a local Ray Train job."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of the progress line."),
) -> None:
    """Run one recipe locally (no server). Exit 0 on success, 1 on divergence, 2 on a bad recipe."""
    from contracts.checkpoint import CorruptCheckpoint
    from contracts.wire import AttemptSpec
    from workers.data import SpecError
    from workers.entry import EngineConfigError
    from workers.faults import InjectedCrash

    recipe = _load(recipe_file, steps, workers)
    for warning in recipe.warnings():
        typer.echo(f"warning: {warning}", err=True)
    tmp = None if checkpoint_dir is not None else tempfile.mkdtemp(prefix="ballast-train-")
    ckpt_dir = str(checkpoint_dir if checkpoint_dir is not None else tmp)
    spec = AttemptSpec(recipe=recipe, checkpoint_dir=ckpt_dir, resume_from=str(resume) if resume else None,
                       allowed_import_modules=list(get_settings().allowed_import_modules))
    console = Console(stderr=True)
    progress = None if as_json else Progress(
        MofNCompleteColumn(), BarColumn(bar_width=20), TextColumn("{task.description}"), TimeElapsedColumn(),
        console=console, transient=False,
    )
    sink = ProgressSink(progress, recipe.training.max_steps)
    started = time.perf_counter()
    try:
        with _stop_on_sigint(sink):
            if progress is not None:
                progress.start()
            try:
                if recipe.resources.num_workers > 1:
                    result = _train_ray(spec, sink)
                else:
                    from workers.entry import run_attempt

                    result = run_attempt(spec, sink).to_dict()
            finally:
                if progress is not None:
                    progress.stop()
    except (SpecError, EngineConfigError, RecipeError, CorruptCheckpoint, FileNotFoundError) as exc:
        raise fail(str(exc)) from None
    except InjectedCrash as exc:
        typer.echo(f"crashed: {exc}", err=True)
        raise typer.Exit(EXIT_CRASHED) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - started
    if as_json:
        typer.echo(json.dumps(result, indent=2, allow_nan=False))
    else:
        _summary(Console(), result, elapsed, None if tmp is not None else ckpt_dir)
    raise typer.Exit(EXIT_CODES.get(result["outcome"], 1))


def _train_ray(spec: Any, sink: ProgressSink) -> dict[str, Any]:
    """N workers through a local Ray Train run. The worker group is launched, drained, stopped and ended
    through the scheduler's ``RayLauncher``, the one client of the channel actor's protocol (acknowledged
    events, plan answers, stop, kill); this process only plays the part of a store that keeps one attempt."""
    import ray

    from orchestrator.scheduler import RayLauncher

    recipe = spec.recipe
    started_ray = False
    if not ray.is_initialized():
        ray.init(num_cpus=max(2, int(recipe.resources.num_workers * recipe.resources.cpus_per_worker) + 1),
                 include_dashboard=False, log_to_driver=False)
        started_ray = True
    launcher = RayLauncher(get_settings())
    handle = None
    try:
        storage = str(Path(spec.checkpoint_dir).resolve())
        launch = {
            "spec": spec.to_dict(), "attempt": spec.attempt, "num_workers": recipe.resources.num_workers,
            "cpus_per_worker": recipe.resources.cpus_per_worker, "use_gpu": recipe.resources.use_gpu,
            "gpus_per_worker": recipe.resources.gpus_per_worker, "run_name": "ballast-train",
            "storage_path": storage, "checkpoint_uri_prefix": f"{storage}/ballast-train",
        }
        handle = launcher.launch(name=f"ballast-train-{uuid.uuid4().hex[:8]}", run_id=0, attempt=spec.attempt,
                                 launch=launch)
        end = _drain(launcher, handle, sink)
        metrics = sink.of_type("metric")
        return {
            **end,
            "losses": [m["loss"] for m in metrics],
            "findings": sink.of_type("anomaly"),
            "evals": sink.of_type("eval"),
            "checkpoints": [{"step": c["step"], "path": c["uri"], "healthy": c["healthy"]}
                            for c in sink.of_type("checkpoint")],
            "skipped_steps": [m["step"] for m in metrics if m.get("skipped")],
        }
    finally:
        if handle is not None:
            launcher.kill(handle)
        if started_ray:
            ray.shutdown()


def _drain(launcher: Any, handle: Any, sink: ProgressSink) -> dict[str, Any]:
    """Feed the channel's events to ``sink`` until the worker group ends; the attempt's ``end`` event data.
    One attempt here: an in-place plan request is answered "no" (the attempt ends as it is)."""
    acked: dict[int, int] = {}
    stop_sent = False
    end: dict[str, Any] | None = None
    while True:
        polled = launcher.poll(handle, acked)
        if polled is None:  # the actor is busy: ask again
            continue
        for event in polled["events"]:
            acked[int(event["attempt"])] = max(acked.get(int(event["attempt"]), 0), int(event["seq"]))
            sink.emit(event["type"], event["data"])
            if event["type"] == "end":
                end = event["data"]
        for request in polled.get("plan_requests", []):
            launcher.answer_plan(handle, int(request["attempt"]), None)
        if sink.stop_requested and not stop_sent:
            launcher.request_stop(handle)
            stop_sent = True
        fit = polled["fit"]
        if fit["state"] in ("done", "failed"):
            if end is None:
                raise RuntimeError(f"the Ray Train run failed: {fit['error']}" if fit["state"] == "failed"
                                   else "the Ray Train run ended without an end event")
            return end
        time.sleep(0.25)
