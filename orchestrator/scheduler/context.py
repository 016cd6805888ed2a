"""What every part of the scheduler shares: its identity and settings, the worker groups it drives, and the few
helpers they all need (a run's attempt by number, its validated recipe, letting go of a claim)."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from contracts.recipe import Recipe, admitted_modules, validate_recipe_data
from orchestrator.policy.states import TERMINAL_RUN_STATES, RunState
from orchestrator.settings import Settings
from orchestrator.store.models import Attempt, Run, utcnow

if TYPE_CHECKING:
    from orchestrator.scheduler.launcher import Launcher


@dataclass
class Execution:
    """A worker group this scheduler drives."""

    run_id: int
    name: str
    handle: Any
    attempt: int
    """The attempt the worker group runs now (it moves on with in-place recoveries)."""
    demand_cpus: float
    started: bool = False
    stop_sent_at: float | None = None
    progress_at: float | None = None
    """When (monotonic) this scheduler last drained events of the current attempt: the step-progress deadline
    counts from it (None: no event yet, the group is starting up)."""


@dataclass
class Context:
    """One scheduler: who it is, where the store and the compute are, and what it drives."""

    settings: Settings
    sf: sessionmaker[Session]
    id: str
    launcher: Launcher
    lease_seconds: float
    train_fn: str | None = None
    """The per-worker entry to launch (None: the channel's default); set by tests, never by a recipe."""
    executions: dict[int, Execution] = field(default_factory=dict)

    def lease_until(self) -> datetime:
        return utcnow() + timedelta(seconds=self.lease_seconds)

    def recipe(self, run: Run) -> Recipe:
        """The run's stored recipe, validated again (its import strings were admitted at submission)."""
        parsed = run.recipe.parsed
        return validate_recipe_data(
            parsed, allowed_import_modules=admitted_modules(parsed, self.settings.allowed_import_modules)
        )


def attempt_of(run: Run, number: int) -> Attempt:
    for a in run.attempts:
        if a.number == number:
            return a
    raise LookupError(f"run {run.id} has no attempt {number}")


def cpu_demand(recipe: Recipe) -> float:
    return recipe.resources.num_workers * recipe.resources.cpus_per_worker


def cannot_fit(recipe: Recipe, capacity: dict[str, float] | None) -> str | None:
    """Why the run can never be placed on a cluster of ``capacity`` (None: it fits, or the capacity is unknown),
    e.g. "needs 4096 CPUs; the cluster has 2"."""
    if capacity is None:
        return None
    res = recipe.resources
    needs = {"CPU": cpu_demand(recipe), "GPU": res.num_workers * res.gpus_per_worker if res.use_gpu else 0.0}
    per_worker = {"CPU": res.cpus_per_worker, "GPU": res.gpus_per_worker}
    for kind, needed in needs.items():
        has = capacity.get(kind, 0.0)
        if needed > has + 1e-9:
            return (f"needs {needed:g} {kind}s; the cluster has {has:g} (resources.num_workers {res.num_workers} "
                    f"x {kind.lower()}s_per_worker {per_worker[kind]:g})")
    return None


def clear_claim(run: Run) -> None:
    run.claimed_by = None
    run.lease_expires_at = None


def release_if_done(run: Run) -> None:
    """A run that left the active states (finished, or back in the queue) is no longer this scheduler's."""
    if run.state in TERMINAL_RUN_STATES or run.state == RunState.queued.value:
        clear_claim(run)
