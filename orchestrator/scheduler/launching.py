"""Starting a worker group: the attempt's ``AttemptSpec`` (effective recipe, resume point, plan) and the launch
description, committed before Ray is asked; an attempt that cannot be prepared or started fails its run.

The launch of a run's first attempt (and of a manual retry) asks the channel for a **preflight probe** first
(``orchestrator.channel.run_preflight``): a small Ray task that builds rank 0's data and model and runs one
forward, so a recipe that cannot run (a factory the cluster cannot import, a model that breaks the contract) fails
its run as ``config_error`` in seconds instead of being restarted as a crash. Retries skip it: their setup has
been seen to work. A deterministic problem found here (the stored recipe, the ``code`` section) is a config error
too; anything else that stops the launch is a failed start."""

from __future__ import annotations

import logging
import uuid
from typing import Any

from sqlalchemy.orm import Session

from contracts.recipe import BUILTIN_MODELS, Recipe, RecipeError, admitted_modules, named_modules
from contracts.recipe.data import COMPATIBLE_DATA
from contracts.storage import StorageOptions
from contracts.wire import AttemptSpec, ProbePlan, one_line
from orchestrator.channel import NAMESPACE
from orchestrator.policy.recovery import effective_recipe, manual_retry_checkpoint
from orchestrator.policy.rules import Happening, Note, Situation, Why, resolve
from orchestrator.policy.states import TERMINAL_ATTEMPT_STATES, TERMINAL_RUN_STATES, AttemptState, RunState
from orchestrator.runtime_env import CodeError, build_runtime_env
from orchestrator.scheduler.context import Context, Execution, attempt_of, clear_claim, cpu_demand
from orchestrator.scheduler.failures import Failure
from orchestrator.scheduler.outcomes import conclude
from orchestrator.store.actions import MANUAL_RETRY_KIND
from orchestrator.store.checkpoints import mark_corrupt, verify_checkpoint
from orchestrator.store.db import transaction
from orchestrator.store.models import Attempt, CheckpointRow, Run
from orchestrator.store.records import run_checkpoints, run_history, with_verdict
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
        lr_probe=ProbePlan.from_plan(plan),
    )
    return spec.to_dict()


PREFLIGHT_KINDS = frozenset({"initial", "manual"})
"""Attempts whose launch probes the setup first: a run's first, and a manual retry (the recipe may have been
fixed, or the cluster's code changed)."""


BUILTIN_DATA = frozenset(name for model in BUILTIN_MODELS for name in COMPATIBLE_DATA[model])
"""The synthetic data of the built-in models (contracts' pairings). With ``BUILTIN_MODELS``: Ballast's own code,
needing nothing outside the recipe (no factory to import, no dataset or file to read). A recipe made only of these,
shipping no ``code``, has nothing a probe could find that the workers' own setup does not classify as a config error
as well."""


def needs_preflight(recipe: Recipe) -> bool:
    """Whether the recipe's setup depends on anything outside Ballast: user code (a factory, the ``code`` section),
    a dataset, a pretrained model, a tokens file, a custom loss. Only those are probed before the worker group (unless
    ``preflight_builtin_recipes``); the probe would cost a built-in recipe a process spawn and a torch import."""
    return (recipe.code.shipped or recipe.model.name not in BUILTIN_MODELS
            or recipe.data.name not in BUILTIN_DATA or bool(named_modules(recipe.model_dump(mode="json"))))


def launch(ctx: Context, run_id: int, number: int) -> None:
    """Start a worker group for the run's pending attempt ``number`` (committing the names first)."""
    try:
        with transaction(ctx.sf) as s:
            name, launch_doc, demand = _prepare(ctx, s, run_id, number)
    except (RecipeError, CodeError) as exc:  # deterministic: the recipe cannot run as written
        log.warning("run %s: attempt %s cannot run as configured: %s", run_id, number, exc)
        fail_config(ctx, run_id, number, str(exc))
        return
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
    if attempt.kind == MANUAL_RETRY_KIND:
        verify_manual_resume(s, run, attempt, ctx.settings.checkpoint_storage())
    spec = spec_dict(ctx, s, run, attempt)
    recipe = ctx.recipe(run)
    res = recipe.resources
    run_name = f"run-{run.id}-attempt-{number}"
    root = ctx.settings.checkpoint_root
    runtime_env = build_runtime_env(recipe.code, ctx.settings)
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
    if runtime_env:
        doc["runtime_env"] = runtime_env
    timeout = ctx.settings.preflight_timeout_seconds
    if timeout > 0 and attempt.kind in PREFLIGHT_KINDS and (
            ctx.settings.preflight_builtin_recipes or needs_preflight(recipe)):
        doc["preflight"] = {"timeout_s": timeout, "num_cpus": min(1.0, float(res.cpus_per_worker))}
    if ctx.train_fn:
        doc["train_fn"] = ctx.train_fn
    standby = ctx.launcher.standby_for(doc)  # a worker group started ahead of demand, waiting for a run
    name = standby or f"ballast-r{run.id}-a{number}-{uuid.uuid4().hex[:8]}"
    attempt.ray_info = {**(attempt.ray_info or {}), "channel": name, "namespace": NAMESPACE, "run_name": run_name,
                        "storage_path": root, "scheduler": ctx.id, **({"standby": True} if standby else {})}
    starting = resolve(Situation(Happening.LAUNCHING, run=RunState(run.state)))
    apply_transitions(session=s, resolution=starting, run=run,
                      notes={Why.EVENT: Note(f"starting attempt {number}", {"attempt": number})})
    return name, doc, cpu_demand(recipe)


def standby_template(ctx: Context) -> dict[str, Any]:
    """The launch a standby worker group is started from (``Launcher.keep_standby``): the common shape, one worker
    of ``standby_cpus`` CPUs, no GPU, this scheduler's checkpoint storage; a run's launch fills in the rest."""
    return {
        "storage_path": ctx.settings.checkpoint_root,
        "storage": ctx.settings.checkpoint_storage().to_dict(),
        "num_workers": 1,
        "cpus_per_worker": ctx.settings.standby_cpus,
        "use_gpu": False,
        "gpus_per_worker": 0.0,
    }


def verify_manual_resume(s: Session, run: Run, attempt: Attempt, storage: StorageOptions | None = None) -> None:
    """A manual retry's checkpoint was chosen by the API, which need not see checkpoint storage: verify it here,
    before a worker loads it. A corrupt one is marked (``mark_corrupt``) and the lineage rule asked again, so the
    attempt resumes from the next valid checkpoint (or initialisation) instead of burning a crash restart."""
    while attempt.parent_checkpoint_id is not None:
        row = s.get(CheckpointRow, attempt.parent_checkpoint_id)
        problem = verify_checkpoint(row.uri, row.sha256, storage=storage) if row is not None else "missing"
        if problem is None:
            return
        step = row.step if row is not None else attempt.resume_step
        if row is not None:
            mark_corrupt(s, row, problem)
        resume = manual_retry_checkpoint(run_history(run), run_checkpoints(s, run))
        attempt.parent_checkpoint_id = resume.id if resume is not None else None
        attempt.resume_step = resume.step if resume is not None else 0
        plan = dict(attempt.plan or {})
        plan["resume_uri"] = resume.uri if resume is not None else None
        if resume is None:
            plan["rewarm_steps"] = 0
        attempt.plan = plan
        where = f"step {resume.step}" if resume is not None else "initialisation"
        attempt.reason = (f"{attempt.reason}; the step-{step} checkpoint failed verification ({one_line(problem)}), "
                          f"resuming from {where}")
        s.flush()


def fail_config(ctx: Context, run_id: int, number: int, message: str) -> None:
    """The attempt cannot run as configured (found at launch): it ends ``config_error``, and the run fails."""
    with transaction(ctx.sf) as s:
        run = s.get(Run, run_id, populate_existing=True)
        if run is None or run.state in TERMINAL_RUN_STATES:
            return
        attempt = attempt_of(run, number)
        if attempt.state in TERMINAL_ATTEMPT_STATES:
            return
        conclude(ctx, s, run, attempt, AttemptState.config_error, Failure(message), stage="launch")


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
