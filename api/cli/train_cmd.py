"""`ballast train RECIPE.yaml`: run a recipe locally, without the service, with a live progress line, and
recover from divergences the way the service does.

Each attempt runs in this process (world size 1), or with ``--workers N`` as a local Ray Train run of N CPU
workers; after a divergence or a crash the recovery policy the orchestrator applies (``api/cli/local_run.py``)
picks the checkpoint and the tightened settings of the next attempt, until one succeeds or the policy gives up.
Exit codes: 0 succeeded, 1 diverged (the policy gave up), 2 bad recipe, setting or checkpoint, 3 crashed (the
last attempt crashed, e.g. an injected crash fault), 130 cancelled (Ctrl-C). A kill_worker fault SIGKILLs this
process in-process mode, as it would a worker.
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
from api.cli.local_run import AttemptCrashed, Ended, LocalAttempt, LocalOutcome, LocalRun, result_from_sink
from api.cli.render import number
from contracts.recipe import Recipe, RecipeError, load_recipe
from contracts.wire import AttemptSpec, EndEvent
from orchestrator.settings import get_settings
from workers.sinks import ListSink

EXIT_CRASHED = 3
"""The last attempt crashed (e.g. an injected corrupt_checkpoint fault): it died the way a worker would."""
EXIT_CODES = {"succeeded": 0, "diverged": 1, "crashed": EXIT_CRASHED, "cancelled": 130}


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
def _stop_on_sigint(loop: LocalRun) -> Iterator[None]:
    """First Ctrl-C asks the attempt to stop after the current step (and no other to start); a second one
    interrupts at once."""
    previous = signal.getsignal(signal.SIGINT)

    def handler(signum: int, frame: FrameType | None) -> None:
        if loop.stop_requested:
            raise KeyboardInterrupt
        loop.request_stop()

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
            warmup = recipe.schedule.warmup_steps
            if warmup:  # a step-count warmup keeps its share of the run (a warmup_fraction scales by itself)
                scaled = min(steps - 1, max(1, round(warmup * steps / recipe.training.max_steps)))
                if scaled != warmup:
                    overrides["schedule.warmup_steps"] = [warmup, scaled]
                    typer.echo(f"--steps {steps}: schedule.warmup_steps {warmup} → {scaled} (the warmup keeps its "
                               "share of the run)", err=True)
        if workers is not None:
            overrides["resources.num_workers"] = [recipe.resources.num_workers, workers]
        return apply_overrides(recipe, overrides, allowed_import_modules=settings.allowed_import_modules)
    except RecipeError as exc:
        hint = f" (with --steps {steps}: give more steps or edit the recipe)" if steps is not None else ""
        raise fail("; ".join(f"{path}: {e}{hint}" for e in exc.errors)) from None


def _changes(overrides: dict[str, list[Any]]) -> str:
    return ", ".join(f"{path} {old} → {new}" for path, (old, new) in overrides.items()) or "the recipe's settings"


def attempt_started(a: LocalAttempt) -> str:
    """One line: where an attempt starts and with what (the first one: only if it resumes)."""
    if a.resumed_from is not None:
        where = f"from the step-{a.resumed_from.step} checkpoint"
        if a.resumed_from.attempt_number:
            where += f" of attempt {a.resumed_from.attempt_number}"
    else:
        where = "from initialisation"
    extra = ""
    if a.spec.rewarm_steps:
        extra += f", re-warm {a.spec.rewarm_steps} steps"
    if a.spec.data_offset:
        extra += f", data offset {a.spec.data_offset}"
    return f"attempt {a.number} ({a.kind}) {where} with {_changes(a.overrides)}{extra}"


def attempt_ended(a: LocalAttempt) -> str:
    """One line: how an attempt ended and what the policy decided after it."""
    ended = a.ended
    assert ended is not None
    end, result = ended.end, ended.result
    line = f"attempt {a.number} {ended.outcome}"
    if ended.outcome == "diverged" and end is not None:
        onset = end.onset_step if end.onset_step is not None else end.final_step
        line += f" at step {onset} ({end.detector or 'anomaly'})"
    line += f", reached step {result.get('final_step')}"
    if ended.error:
        line += f": {ended.error}"
    if a.decision is not None:
        line += f"\n  → {a.decision}"
    return line


def _summary(console: Console, run: LocalOutcome, elapsed: float, kept_dir: str | None) -> None:
    for a in run.attempts:
        if a.number > 1 or a.resumed_from is not None:
            console.print(attempt_started(a), highlight=False)
        console.print(attempt_ended(a), highlight=False)
    result = run.to_dict()
    count = len(run.attempts)
    console.print(
        f"[bold]{result['outcome']}[/] after {result['final_step']} steps, {count} attempt{'s' if count > 1 else ''}, "
        f"in {elapsed:.1f}s"
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
        console.print(f"reason: {result['reason']}", highlight=False)
    if run.gave_up:
        console.print(f"gave up: {run.gave_up}", highlight=False)
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
        None, "--checkpoint-dir",
        help="Keep checkpoints here, one attempt-N directory per attempt (default: a temporary directory, removed "
             "after).",
    ),
    resume: Path | None = typer.Option(None, "--resume", help="Resume attempt 1 from this checkpoint directory."),
    workers: int | None = typer.Option(
        None, "--workers", min=1, help="Data-parallel workers; more than 1 runs each attempt as a local Ray Train job."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON instead of the progress line."),
) -> None:
    """Run one recipe locally (no server), recovering from divergences by the recipe's recovery policy.

    Exit 0 on success, 1 when it diverged and the policy gave up, 2 on a bad recipe, 3 when it crashed."""
    from contracts.checkpoint import CorruptCheckpoint
    from workers.data import SpecError
    from workers.entry import EngineConfigError

    recipe = _load(recipe_file, steps, workers)
    for warning in recipe.warnings():
        typer.echo(f"warning: {warning}", err=True)
    tmp = None if checkpoint_dir is not None else tempfile.mkdtemp(prefix="ballast-train-")
    root = Path(checkpoint_dir if checkpoint_dir is not None else str(tmp))
    console = Console(stderr=True)
    progress = None if as_json else Progress(
        MofNCompleteColumn(), BarColumn(bar_width=20), TextColumn("{task.description}"), TimeElapsedColumn(),
        console=console, transient=False,
    )

    def make_sink(spec: AttemptSpec, start_step: int) -> ProgressSink:
        return ProgressSink(progress, spec.recipe.training.max_steps, start_step)

    def said(line: str) -> None:
        if progress is not None:
            progress.console.print(line, highlight=False)

    started = time.perf_counter()
    try:
        with _runner(recipe, root) as runner:
            loop = LocalRun(
                recipe, root, runner, make_sink=make_sink,
                allowed_import_modules=get_settings().allowed_import_modules,
                export=get_settings().export_targets(),
                on_start=lambda a: said(attempt_started(a)) if a.number > 1 else None,
                on_end=lambda a: said(attempt_ended(a)),
            )
            with _stop_on_sigint(loop):
                if progress is not None:
                    progress.start()
                try:
                    outcome = loop.run(str(resume) if resume is not None else None)
                finally:
                    if progress is not None:
                        progress.stop()
    except (SpecError, EngineConfigError, RecipeError, CorruptCheckpoint, FileNotFoundError) as exc:
        raise fail(str(exc)) from None
    except KeyboardInterrupt:  # the second Ctrl-C
        typer.echo("cancelled", err=True)
        raise typer.Exit(EXIT_CODES["cancelled"]) from None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    elapsed = time.perf_counter() - started
    code = EXIT_CODES.get(outcome.outcome, 1)
    if as_json:
        typer.echo(json.dumps({**outcome.to_dict(), "exit_code": code}, indent=2, allow_nan=False))
    else:
        _summary(Console(highlight=False, soft_wrap=True), outcome, elapsed, None if tmp is not None else str(root))
    raise typer.Exit(code)


@contextmanager
def _runner(recipe: Recipe, root: Path) -> Iterator[Any]:
    """The attempt runner for this recipe: in this process, or (``num_workers > 1``) a local Ray Train run per
    attempt, with Ray started once for all of them."""
    if recipe.resources.num_workers <= 1:
        yield run_in_process
        return
    with _RayAttempts(recipe, root) as runner:
        yield runner


def run_in_process(spec: AttemptSpec, sink: ListSink) -> Ended:
    """The in-process ``AttemptRunner``: one attempt in this process (world size 1)."""
    from workers.entry import run_attempt
    from workers.faults import InjectedCrash

    try:
        result = run_attempt(spec, sink)
    except InjectedCrash as exc:
        raise AttemptCrashed(str(exc)) from exc
    return Ended(result.outcome, result.end(), result.to_dict())


class _RayAttempts:
    """N workers through a local Ray Train run per attempt. Each worker group is launched, drained, stopped and
    ended through the scheduler's ``RayLauncher``, the one client of the channel actor's protocol (acknowledged
    events, plan answers, stop, kill); this process only plays the part of a store that keeps the attempts."""

    def __init__(self, recipe: Recipe, root: Path) -> None:
        self.recipe = recipe
        self.storage = str(root.resolve())
        self.started_ray = False

    def __enter__(self) -> _RayAttempts:
        import ray

        from orchestrator.scheduler import RayLauncher

        res = self.recipe.resources
        if not ray.is_initialized():
            ray.init(address="local", num_cpus=max(2, int(res.num_workers * res.cpus_per_worker) + 1),
                     include_dashboard=False, log_to_driver=False)
            self.started_ray = True
        self.launcher = RayLauncher(get_settings())
        return self

    def __exit__(self, *exc: object) -> None:
        import ray

        if self.started_ray:
            ray.shutdown()

    def __call__(self, spec: AttemptSpec, sink: ProgressSink) -> Ended:
        recipe = spec.recipe
        run_name = f"attempt-{spec.attempt}"
        launch = {
            "spec": spec.to_dict(), "attempt": spec.attempt, "num_workers": recipe.resources.num_workers,
            "cpus_per_worker": recipe.resources.cpus_per_worker, "use_gpu": recipe.resources.use_gpu,
            "gpus_per_worker": recipe.resources.gpus_per_worker, "run_name": run_name,
            "storage_path": self.storage, "checkpoint_uri_prefix": f"{self.storage}/{run_name}",
        }
        handle = self.launcher.launch(name=f"ballast-train-{uuid.uuid4().hex[:8]}", run_id=0, attempt=spec.attempt,
                                      launch=launch)
        try:
            end = _drain(self.launcher, handle, sink)
        finally:
            self.launcher.kill(handle)
        outcome = str(end.get("outcome"))
        return Ended(outcome, EndEvent.from_dict(end), result_from_sink(sink, outcome, end=end))


def _drain(launcher: Any, handle: Any, sink: ProgressSink) -> dict[str, Any]:
    """Feed the channel's events to ``sink`` until the worker group ends; the attempt's ``end`` event data
    (``AttemptCrashed`` when the group failed or ended without one). An in-place plan request is answered "no":
    the attempt ends as it is, and the local loop starts the next one."""
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
                raise AttemptCrashed(f"the Ray Train run failed: {fit['error']}" if fit["state"] == "failed"
                                     else "the Ray Train run ended without an end event")
            return end
        time.sleep(0.25)
