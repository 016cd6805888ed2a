"""Where an attempt starts: ``run_attempt`` in a plain process, ``train_loop_per_worker`` on Ray Train.

Both run the same loop of attempts in one worker group: the spec's attempt, then, while a diverged attempt's sink
hands back an in-place recovery plan (``PlanningSink.request_plan``, rank 0 only, broadcast to every rank), the
next attempt from the plan's checkpoint with its overrides. An attempt whose spec asks for an LR probe runs it
first (``workers/lr_probe.py``) and trains at the LR it chose. A plain process is world size 1 or a rank of an
already initialised ``torch.distributed`` group; under Ray Train the ranks come from the train context and
rank 0 writes checkpoints under the launch's ``checkpoint_uri_prefix`` itself (``workers/checkpointing.py``):
nothing goes through ``ray.train.report``. Ray Train never restarts a group (``FailureConfig(max_failures=0)``):
a resume is the spec's ``resume_from``, chosen by the scheduler from Ballast's store.

Under Ray Train a deterministic setup error (``workers.preflight.CONFIG_ERRORS``: a factory that cannot be
imported or breaks the contract, a setting the engine refuses) is classified here: rank 0 reports it as a
``config_error`` end event naming the field, and every rank raises ``SetupConfigError``, so the group ends at once
and the scheduler fails the run instead of restarting it as a crash. ``run_attempt`` (a plain process, ``ballast
train``) lets the original exception through.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from contracts.overrides import apply_overrides
from contracts.storage import StorageOptions
from contracts.wire import CONFIG_ERROR, AttemptOutcome, AttemptSpec, SetupConfigError, one_line
from workers.checkpointing import materialize
from workers.comm import EngineConfigError
from workers.context import WorkerContext, broadcast_object, plain_context
from workers.lr_probe import run_probe
from workers.preflight import CONFIG_ERRORS, MESSAGE_LIMIT
from workers.sinks import EventSink
from workers.trackers import TrackerExport
from workers.trainer import GuardedTrainer


def next_spec(spec: AttemptSpec, plan: Mapping[str, Any]) -> AttemptSpec:
    """The next attempt from an in-place plan: either a full spec or overrides on the current recipe."""
    if plan.get("spec"):
        return AttemptSpec.from_dict(plan["spec"])
    recipe = apply_overrides(spec.recipe, plan.get("overrides") or {},
                             allowed_import_modules=spec.allowed_import_modules or None)
    return AttemptSpec(
        recipe=recipe, checkpoint_dir=str(plan.get("checkpoint_dir") or spec.checkpoint_dir),
        attempt=int(plan["attempt"]), resume_from=plan.get("resume_from"),
        rewarm_steps=int(plan.get("rewarm_steps", 0)), data_offset=int(plan.get("data_offset", spec.data_offset)),
        run_id=spec.run_id, allowed_import_modules=spec.allowed_import_modules,
    )


def _request_plan(sink: EventSink | None, result: AttemptOutcome, ctx: WorkerContext) -> dict[str, Any] | None:
    """Rank 0 asks its sink for an in-place plan after a rollback; every rank gets the answer."""
    plan: dict[str, Any] | None = None
    request = getattr(sink, "request_plan", None)
    if ctx.is_main and callable(request):
        plan = request(result.end_event())
    answer: dict[str, Any] | None = broadcast_object(plan, ctx)
    return answer


def compute_threads(spec: AttemptSpec) -> int:
    """Torch intra-op threads of a rank: the CPUs the recipe reserves per worker. Part of the run's determinism:
    the order of a multi-threaded reduction changes the last bits, so ``ballast train`` on a laptop and a Ray
    worker of the service end the same chaotic recipe at the same loss only with the same thread count."""
    return max(1, int(spec.recipe.resources.cpus_per_worker))


Marker = Callable[[str], None]
"""Records a start-up timing mark by name (rank 0 under Ray Train: ``RunChannel.add_marks``)."""


def run_attempts(spec: AttemptSpec, ctx: WorkerContext, sink: EventSink | None, resume: str | None,
                 mark: Marker | None = None) -> AttemptOutcome:
    """Run attempts in this worker group: the spec's, then any in-place recovery plan the sink hands back.

    Returns the last attempt's outcome, with the earlier ones in ``previous``. ``mark("setup_done")`` is called
    once the first attempt's trainer (data, model, optimizer, resume) is built.
    """
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    threads_before = torch.get_num_threads()
    torch.set_num_threads(compute_threads(spec))
    history: list[AttemptOutcome] = []
    export = TrackerExport.open(spec, ctx)  # telemetry.export: TensorBoard / MLflow, rank 0 only
    try:
        while True:
            probed: dict[str, Any] | None = None
            with materialize(resume, ctx.storage) as resume_dir:
                if spec.lr_probe is not None:
                    spec, probed = run_probe(spec, spec.lr_probe, ctx, resume_dir, sink)
                    if sink is not None:
                        sink.emit("lr_probe", probed)
                attempt_sink = sink if export is None else export.tee(sink, spec, resume)
                trainer = GuardedTrainer(spec, ctx, attempt_sink, resume_dir=resume_dir)
            trainer.result.lr_probe = probed
            if mark is not None:
                mark("setup_done")
                mark = None
            result = trainer.train()
            plan = None
            if result.outcome == "diverged" and spec.recipe.recovery.in_place:
                plan = _request_plan(sink, result, ctx)
            if not plan:
                result.previous = history
                return result
            history.append(result)
            spec = next_spec(spec, plan)
            resume = spec.resume_from
    finally:
        if export is not None:
            export.close()
        torch.use_deterministic_algorithms(deterministic_before)
        torch.set_num_threads(threads_before)


def run_attempt(spec: AttemptSpec, sink: EventSink | None = None) -> AttemptOutcome:
    """Run one attempt in this process (world size 1, or the ranks of an initialised process group)."""
    ctx = plain_context(spec.recipe)
    Path(spec.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    return run_attempts(spec, ctx, sink, spec.resume_from)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train V2 entry: ``config = {"spec": AttemptSpec dict, "sink": EventSink | None,
    "checkpoint_uri_prefix": str, "storage": StorageOptions dict}``. Rank 0 writes checkpoints to
    ``<checkpoint_uri_prefix>/step_XXXXXXXX`` and announces them, like all telemetry, through the sink."""
    import ray.train
    import ray.train.torch

    entered = time.time()
    spec = AttemptSpec.from_dict(config["spec"])
    tc = ray.train.get_context()
    ctx = WorkerContext(
        rank=tc.get_world_rank(), world_size=tc.get_world_size(), device=ray.train.torch.get_device(),
        ray_train=True, checkpoint_uri_prefix=config.get("checkpoint_uri_prefix"),
        storage=StorageOptions.from_dict(config.get("storage")), node=ray.get_runtime_context().get_node_id(),
    )
    sink = config.get("sink") if ctx.is_main else None
    mark = start_marker(config.get("marks") if ctx.is_main else None, entered)
    try:
        run_attempts(spec, ctx, sink, spec.resume_from, mark)
    except CONFIG_ERRORS as exc:
        raise report_config_error(exc, spec, sink) from exc


STANDBY_POLL_S = 0.05
"""How often a standby worker asks its channel for a launch (a local actor call: ~20 cheap calls a second)."""


def standby_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train V2 entry of a **standby** worker group (``RunChannel.start_standby``; one worker): import what an
    attempt needs, ``torch._dynamo`` included (the first optimizer imports it: seconds in a cold process), mark
    ``standby_ready``, then wait for the launch a run's claim hands the channel and run it as
    ``train_loop_per_worker`` would. A standby that no run takes is killed (``RayLauncher``), not asked to stop."""
    import ray
    import torch._dynamo  # noqa: F401 - the import is the point

    channel = config["marks"]
    try:  # the placement group, so that retiring the standby (a kill) frees its CPUs: see ActorSink._register
        group = ray.util.get_current_placement_group()
    except Exception:  # noqa: BLE001 - outside a placement group: nothing to free
        group = None
    channel.register_worker.remote({"placement_group": group})
    channel.add_marks.remote({"standby_ready": time.time()})
    while (launch := ray.get(channel.take_launch.remote())) is None:
        time.sleep(STANDBY_POLL_S)
    train_loop_per_worker(worker_config(launch, channel))


def worker_config(launch: Mapping[str, Any], channel: Any) -> dict[str, Any]:
    """``train_loop_per_worker``'s config for a launch reporting to ``channel`` (a ``RunChannel`` handle): built by
    the channel for a fresh worker group, by the worker itself for a standby's."""
    from workers.ray_sink import ActorSink

    return {
        "spec": launch["spec"],
        "sink": ActorSink(channel, attempt=int(launch["attempt"])),
        "checkpoint_uri_prefix": launch["checkpoint_uri_prefix"],
        "storage": launch.get("storage") or {},
        "marks": channel,
    }


def start_marker(channel: Any, entered: float) -> Marker | None:
    """Rank 0's start-up timing marks, sent fire-and-forget to the run's channel actor: ``worker_process`` (when
    this process was created), ``train_loop`` (``entered``: this function was called) and later names by
    ``mark(name)``. None without a channel (other ranks, tests)."""
    add = getattr(channel, "add_marks", None)
    if add is None:
        return None
    marks = {"train_loop": entered}
    try:
        import psutil  # Ray's own dependency; the mark is skipped without it

        marks["worker_process"] = psutil.Process().create_time()
    except ImportError:
        pass
    add.remote(marks)

    def mark(name: str) -> None:
        add.remote({name: time.time()})

    return mark


def report_config_error(exc: Exception, spec: AttemptSpec, sink: EventSink | None) -> SetupConfigError:
    """A deterministic setup error: rank 0 (the one with a sink) reports it as the attempt's ``config_error``
    end; the ``SetupConfigError`` returned is what every rank raises."""
    message = one_line(exc, MESSAGE_LIMIT)
    if sink is not None:
        ended = AttemptOutcome(outcome=CONFIG_ERROR, attempt=spec.attempt, start_step=0, final_step=0,
                               reason=message)
        sink.emit("end", ended.end_event())
        sink.flush()
    return SetupConfigError(message)


__all__ = ["EngineConfigError", "next_spec", "report_config_error", "run_attempt", "run_attempts",
           "standby_loop_per_worker", "train_loop_per_worker", "worker_config"]
