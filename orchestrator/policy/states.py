"""Run and attempt state machines: one table of legal transitions each, checked on every change.

Pure (no I/O): the store's ``set_run_state`` / ``set_attempt_state`` consult these tables and write every
change to the event log.
"""

from __future__ import annotations

from enum import StrEnum


class RunState(StrEnum):
    queued = "queued"
    starting = "starting"
    running = "running"
    recovering = "recovering"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"


class AttemptState(StrEnum):
    pending = "pending"
    running = "running"
    succeeded = "succeeded"
    diverged = "diverged"
    crashed = "crashed"
    cancelled = "cancelled"
    config_error = "config_error"
    """It cannot run as configured (a deterministic setup error: the preflight probe or the workers' setup);
    never retried."""


class FailureKind(StrEnum):
    """Why a run is ``failed``, as a category a client can branch on (``runs.failure_kind``; the words are in
    ``runs.reason``). Which rule fails a run names its kind (``orchestrator.policy.rules``)."""

    config_error = "config_error"
    """The recipe cannot run as written: a setup error that no retry fixes (a factory that cannot be imported or
    breaks the contract, a setting the engine refuses, a stored recipe that no longer validates)."""
    gave_up = "gave_up"
    """The recovery policy gave up: budgets spent, knobs at their floors, vanishing gradients, no checkpoint."""
    start_failed = "start_failed"
    """The attempt could not be prepared, or Ray refused to start it."""
    lost = "lost"
    """Adopted from a dead scheduler in a state it cannot continue from."""
    cannot_fit = "cannot_fit"
    """It needs more than the whole cluster has, and the cluster does not autoscale (``cluster_autoscales``)."""


RUN_TRANSITIONS: dict[RunState, frozenset[RunState]] = {
    # claimed by a scheduler, or cancelled before it started
    RunState.queued: frozenset({RunState.starting, RunState.cancelled}),
    # workers came up; or they could not start; or a scheduler lost its claim and re-queues
    RunState.starting: frozenset({RunState.running, RunState.failed, RunState.cancelled, RunState.queued}),
    # an attempt ended: diverged/crashed (recovering), finished, gave up, or was cancelled
    RunState.running: frozenset({RunState.recovering, RunState.succeeded, RunState.failed, RunState.cancelled}),
    # a new attempt starts in a new worker group (starting) or in place (running); or the policy gives up
    RunState.recovering: frozenset({RunState.starting, RunState.running, RunState.failed, RunState.cancelled}),
    RunState.succeeded: frozenset(),
    # a manual retry re-queues a finished-unsuccessfully run
    RunState.failed: frozenset({RunState.queued}),
    RunState.cancelled: frozenset({RunState.queued}),
}

ATTEMPT_TRANSITIONS: dict[AttemptState, frozenset[AttemptState]] = {
    # a setup error may end an attempt before its first event (the preflight probe, the workers' setup)
    AttemptState.pending: frozenset(
        {AttemptState.running, AttemptState.crashed, AttemptState.cancelled, AttemptState.config_error}
    ),
    AttemptState.running: frozenset(
        {AttemptState.succeeded, AttemptState.diverged, AttemptState.crashed, AttemptState.cancelled,
         AttemptState.config_error}
    ),
    AttemptState.succeeded: frozenset(),
    AttemptState.diverged: frozenset(),
    AttemptState.crashed: frozenset(),
    AttemptState.cancelled: frozenset(),
    AttemptState.config_error: frozenset(),
}

TERMINAL_RUN_STATES = frozenset({RunState.succeeded, RunState.failed, RunState.cancelled})
ACTIVE_RUN_STATES = frozenset({RunState.starting, RunState.running, RunState.recovering})
TERMINAL_ATTEMPT_STATES = frozenset(s for s, nxt in ATTEMPT_TRANSITIONS.items() if not nxt)


class IllegalTransition(Exception):
    """A state change the machine does not allow (the API maps it to 409)."""

    def __init__(self, entity: str, current: str, target: str) -> None:
        self.entity, self.current, self.target = entity, current, target
        super().__init__(f"illegal {entity} transition {current} -> {target}")


def check_run_transition(current: RunState | str, target: RunState | str) -> None:
    cur, tgt = RunState(current), RunState(target)
    if tgt not in RUN_TRANSITIONS[cur]:
        raise IllegalTransition("run", cur.value, tgt.value)


def check_attempt_transition(current: AttemptState | str, target: AttemptState | str) -> None:
    cur, tgt = AttemptState(current), AttemptState(target)
    if tgt not in ATTEMPT_TRANSITIONS[cur]:
        raise IllegalTransition("attempt", cur.value, tgt.value)
