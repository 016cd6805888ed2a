"""Starting a worker group: the attempt's ``AttemptSpec`` (effective recipe, resume point, plan) and the launch
description, committed before Ray is asked; an attempt that cannot be prepared or started fails its run."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from sqlalchemy.orm import Session

from contracts.recipe import admitted_modules
from contracts.wire import AttemptSpec, one_line
from orchestrator.channel import NAMESPACE
from orchestrator.policy.recovery import effective_recipe
from orchestrator.policy.rules import Happening, Note, Situation, Why, resolve
from orchestrator.policy.states import TERMINAL_ATTEMPT_STATES, TERMINAL_RUN_STATES, AttemptState, RunState
from orchestrator.scheduler.context import Context, Execution, attempt_of, clear_claim, cpu_demand
from orchestrator.store.db import transaction
from orchestrator.store.models import Attempt, CheckpointRow, Run
from orchestrator.store.records import with_verdict
from orchestrator.store.transitions import apply_transitions

log = logging.getLogger("ballast.scheduler")


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts])


def _resume_uri(s: Session, attempt: Attempt) -> str | None:
    uri = (attempt.plan or {}).get("resume_uri")
    if uri:
        return str(uri)
    if attempt.parent_checkpoint_id is not None:
        row = s.get(CheckpointRow, attempt.parent_checkpoint_id)
        if row is not None:
            return row.uri
    return None


def spec_dict(ctx: Context, s: Session, run: Run, attempt: Attempt) -> dict[str, Any]:
    """The attempt's ``AttemptSpec`` as the workers receive it."""
    parsed = run.recipe.parsed
    recipe = ctx.recipe(run)
    plan = attempt.plan or {}
    spec = AttemptSpec(
        recipe=effective_recipe(recipe, attempt.overrides or {}),
        checkpoint_dir=_join(ctx.settings.checkpoint_root, f"run-{run.id}", f"attempt-{attempt.number}"),
        attempt=attempt.number,
        resume_from=_resume_uri(s, attempt),
        rewarm_steps=int(plan.get("rewarm_steps") or 0),
        data_offset=int(plan.get("data_offset") or 0),
        run_id=run.id,
        allowed_import_modules=admitted_modules(parsed, ctx.settings.allowed_import_modules),
        export=ctx.settings.export_targets() if recipe.telemetry.export else None,
    )
    return spec.to_dict()


def launch(ctx: Context, run_id: int, number: int) -> None:
    """Start a worker group for the run's pending attempt ``number`` (committing the names first)."""
    try:
        with transaction(ctx.sf) as s:
            name, launch_doc, demand = _prepare(ctx, s, run_id, number)
    except Exception as exc:  # noqa: BLE001 - a spec the engine refuses is the run's failure, not ours
        log.exception("run %s: cannot build attempt %s", run_id, number)
        fail_start(ctx, run_id, number, f"attempt {number} could not be prepared: {one_line(exc)}")
        return
    try:
        handle = ctx.launcher.launch(name=name, run_id=run_id, attempt=number, launch=launch_doc)
    except Exception as exc:  # noqa: BLE001 - Ray refused: the run cannot start
        log.exception("run %s: launching attempt %s failed", run_id, number)
        fail_start(ctx, run_id, number, f"attempt {number} could not start on Ray: {one_line(exc)}")
        return
    ctx.executions[run_id] = Execution(run_id=run_id, name=name, handle=handle, attempt=number, demand_cpus=demand)
    log.info("run %s: attempt %s launched as %s", run_id, number, name)


def _prepare(ctx: Context, s: Session, run_id: int, number: int) -> tuple[str, dict[str, Any], float]:
    """Name the worker group, record it on the attempt and build its launch: ``(name, launch, cpu demand)``."""
    run = s.get(Run, run_id, populate_existing=True)
    assert run is not None
    attempt = attempt_of(run, number)
    spec = spec_dict(ctx, s, run, attempt)
    recipe = ctx.recipe(run)
    res = recipe.resources
    name = f"ballast-r{run.id}-a{number}-{uuid.uuid4().hex[:8]}"
    run_name = f"run-{run.id}-attempt-{number}"
    root = ctx.settings.checkpoint_root
    attempt.ray_info = {**(attempt.ray_info or {}), "channel": name, "namespace": NAMESPACE, "run_name": run_name,
                        "storage_path": root, "scheduler": ctx.id}
    starting = resolve(Situation(Happening.LAUNCHING, run=RunState(run.state)))
    apply_transitions(session=s, resolution=starting, run=run,
                      notes={Why.EVENT: Note(f"starting attempt {number}", {"attempt": number})})
    doc: dict[str, Any] = {
        "spec": spec,
        "attempt": number,
        "run_name": run_name,
        "storage_path": root,
        "checkpoint_uri_prefix": _join(root, run_name),
        "storage": ctx.settings.checkpoint_storage().to_dict(),  # may hold keys: never stored in ray_info
        "num_workers": res.num_workers,
        "cpus_per_worker": res.cpus_per_worker,
        "use_gpu": res.use_gpu,
        "gpus_per_worker": res.gpus_per_worker,
    }
    if ctx.train_fn:
        doc["train_fn"] = ctx.train_fn
    return name, doc, cpu_demand(recipe)


def fail_start(ctx: Context, run_id: int, number: int, reason: str) -> None:
    """The attempt could not be prepared or started: it crashed, and the run fails."""
    with transaction(ctx.sf) as s:
        run = s.get(Run, run_id, populate_existing=True)
        if run is None or run.state in TERMINAL_RUN_STATES:
            return
        attempt = attempt_of(run, number)
        if attempt.state not in TERMINAL_ATTEMPT_STATES:
            attempt.outcome = with_verdict(None, AttemptState.crashed.value, reason)
        failed = resolve(Situation(Happening.START_FAILED, run=RunState(run.state),
                                   attempt=AttemptState(attempt.state)))
        apply_transitions(session=s, resolution=failed, run=run, attempt=attempt, notes={Why.EVENT: Note(reason)})
        clear_claim(run)
