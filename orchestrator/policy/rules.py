"""Outcome → transitions: which state changes each thing that happens to a run causes, as an ordered list of rules.

The transition tables (``orchestrator.policy.states``) say what is *legal*; these rules say what is *meant*
(Prefect's orchestration rules are the model). Each rule names the happening it handles (a claim, a start
failure, the first events of an attempt, the end of an attempt together with the recovery policy's decision,
...), the FROM states it applies to and the path of TO states it moves through. The scheduler and the store ask
:func:`resolve` and apply the hops in order through ``set_run_state`` / ``set_attempt_state``, which check the
tables again and write the audit log (``orchestrator.store.transitions.apply_transitions``).

Two facets, each an ordered list in which the first matching rule wins:

- ``ATTEMPT_RULES`` for the attempt the happening concerns (the one that started, failed to start or ended);
- ``RUN_RULES`` for the run; a run rule may also create the next attempt (``NEXT`` → ``pending``: the caller has
  recorded the policy's plan as a new attempt) and move it on (in-place recovery).

A situation that no rule covers is an error (:class:`NoRule`), never a silent no-op. Each hop says *why* it
happens as a role (:class:`Why`); the caller supplies the words for each role (:class:`Note`), since reasons
carry run-specific detail (the scheduler's id, the policy's reason, how the attempt ended).

Pure: no I/O. Every rule is table-tested in ``tests/orchestrator/test_rules.py``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from orchestrator.policy.states import (
    ACTIVE_RUN_STATES,
    TERMINAL_ATTEMPT_STATES,
    AttemptState,
    FailureKind,
    RunState,
)

R, A, F = RunState, AttemptState, FailureKind


class Happening(StrEnum):
    """What happened to a run, as the scheduler or the API saw it."""

    CLAIMED = "claimed"
    """A scheduler took the queued run."""
    RECIPE_INVALID = "recipe_invalid"
    """Claimed, but the stored recipe no longer validates (the run cannot start)."""
    CANCELLED_IN_QUEUE = "cancelled_in_queue"
    """A queued run is cancelled: on request, or found so when claimed."""
    LAUNCHING = "launching"
    """A worker group is being started for the run's pending attempt."""
    START_FAILED = "start_failed"
    """The attempt could not be prepared, or Ray refused to start it."""
    WORKERS_STARTED = "workers_started"
    """The attempt's first events arrived."""
    ENDED = "ended"
    """The attempt ended (``outcome``), and the recovery policy decided what follows (``decision``)."""
    ADOPTED_ENDED = "adopted_ended"
    """Adopted from a dead scheduler: the newest attempt had ended, and nothing was recorded after it."""
    ADOPTED_EMPTY = "adopted_empty"
    """Adopted: an active run without any attempt."""
    ADOPTED_UNSTARTED = "adopted_unstarted"
    """Adopted: the newest attempt never started; it is started now."""
    RETRY_REQUESTED = "retry_requested"
    """A person asked for a manual retry of a failed or cancelled run."""
    CANNOT_FIT = "cannot_fit"
    """Claimed, but the run needs more than the whole cluster has (and no autoscaler is configured to add it)."""


class Decision(StrEnum):
    """The recovery policy's answer after an attempt ended (``NONE``: it was not asked)."""

    NONE = "none"
    RETRY = "retry"
    """A new attempt in a new worker group."""
    IN_PLACE = "in_place"
    """A new attempt in the same worker group (the workers are answered with its spec)."""
    GIVE_UP = "give_up"


class Entity(StrEnum):
    RUN = "run"
    ATTEMPT = "attempt"
    """The attempt the happening concerns."""
    NEXT = "next"
    """The attempt the decision (or a manual retry) creates."""


class Why(StrEnum):
    """The role of a hop's reason; the caller supplies the words (:class:`Note`)."""

    EVENT = "event"
    """The caller's account of what happened: the claim, the failure, how the attempt ended."""
    OUTCOME = "outcome"
    """How the attempt ended, with the end event's numbers (on the attempt itself)."""
    CLAIM = "claim"
    """The claim, on a run that fails at once."""
    STARTED = "started"
    """``workers started``."""
    CANCEL = "cancel"
    """``cancelled on request``."""
    DECISION = "decision"
    """The recovery policy's reason (also the next attempt's ``reason``)."""
    IN_PLACE = "in_place"
    """The next attempt continues in the same worker group."""


@dataclass(frozen=True)
class Note:
    """The words for one role: an audit-log reason and its data."""

    reason: str
    data: dict[str, Any] | None = None


FIXED_NOTES: Mapping[Why, Note] = {Why.STARTED: Note("workers started"), Why.CANCEL: Note("cancelled on request")}
"""Roles whose words never change; a caller's note for the same role wins."""


@dataclass(frozen=True)
class Hop:
    """One state change: ``entity`` moves to ``to``, for the reason in role ``why``."""

    entity: Entity
    to: RunState | AttemptState
    why: Why


@dataclass(frozen=True)
class Situation:
    """The input of the rules. A facet left None (``run`` / ``attempt``) is not resolved."""

    happening: Happening
    run: RunState | None = None
    attempt: AttemptState | None = None
    outcome: AttemptState | None = None
    """ENDED / ADOPTED_ENDED: how the attempt ended (a terminal attempt state)."""
    decision: Decision = Decision.NONE
    cancel_requested: bool = False


@dataclass(frozen=True)
class Rule:
    name: str
    on: frozenset[Happening]
    facet: Entity
    """Whose FROM state the rule matches: the run's or the attempt's."""
    from_states: frozenset[str]
    hops: tuple[Hop, ...]
    """The path of TO states, in order (empty: the happening changes nothing in this facet)."""
    outcomes: frozenset[AttemptState] | None = None
    """The outcomes it handles (None: any)."""
    decisions: frozenset[Decision] | None = None
    """The decisions it handles (None: any)."""
    cancel_requested: bool | None = None
    """Only when a cancel was (True) or was not (False) requested; None: either."""
    launch: bool = False
    """A new worker group is to be started for the next (or the pending) attempt."""
    failure: FailureKind | None = None
    """A run rule that fails the run says why, as a kind (``runs.failure_kind``)."""

    def matches(self, s: Situation) -> bool:
        state = s.run if self.facet is Entity.RUN else s.attempt
        return (
            state is not None
            and s.happening in self.on
            and state.value in self.from_states
            and (self.outcomes is None or s.outcome in self.outcomes)
            and (self.decisions is None or s.decision in self.decisions)
            and (self.cancel_requested is None or s.cancel_requested is self.cancel_requested)
        )


@dataclass(frozen=True)
class Resolution:
    rules: tuple[str, ...]
    """The names of the rules that fired: the attempt's (if resolved), then the run's."""
    hops: tuple[Hop, ...]
    """Every state change, in the order to apply them."""
    launch: bool = False
    failure: FailureKind | None = None
    """The kind of failure, when the run's rule fails the run."""


class NoRule(Exception):
    """No rule covers the situation: a state the scheduler should never be in (it fails loudly instead)."""

    def __init__(self, facet: Entity, situation: Situation) -> None:
        self.facet, self.situation = facet, situation
        super().__init__(f"no {facet.value} rule for {situation}")


# ---------------------------------------------------------------------------------------------------- table
def _states(*states: RunState | AttemptState | Iterable[RunState | AttemptState]) -> frozenset[str]:
    out: set[str] = set()
    for s in states:
        out |= {s.value} if isinstance(s, RunState | AttemptState) else {x.value for x in s}
    return frozenset(out)


def _on(*happenings: Happening) -> frozenset[Happening]:
    return frozenset(happenings)


def _run(to: RunState, why: Why) -> Hop:
    return Hop(Entity.RUN, to, why)


def _attempt(to: AttemptState, why: Why) -> Hop:
    return Hop(Entity.ATTEMPT, to, why)


def _next(to: AttemptState, why: Why) -> Hop:
    return Hop(Entity.NEXT, to, why)


H, D, W = Happening, Decision, Why
_TERMINAL = TERMINAL_ATTEMPT_STATES
_UNENDED = (A.pending, A.running)
_ENDINGS = (H.ENDED, H.ADOPTED_ENDED)


def _attempt_rule(name: str, on: frozenset[Happening], from_states: frozenset[str], *hops: Hop,
                  outcomes: Iterable[AttemptState] | None = None) -> Rule:
    return Rule(name, on, Entity.ATTEMPT, from_states, hops,
                outcomes=frozenset(outcomes) if outcomes is not None else None)


def _run_rule(name: str, on: frozenset[Happening], from_states: frozenset[str], *hops: Hop,
              outcomes: Iterable[AttemptState] | None = None, decisions: Iterable[Decision] | None = None,
              cancel_requested: bool | None = None, launch: bool = False,
              failure: FailureKind | None = None) -> Rule:
    return Rule(name, on, Entity.RUN, from_states, hops,
                outcomes=frozenset(outcomes) if outcomes is not None else None,
                decisions=frozenset(decisions) if decisions is not None else None,
                cancel_requested=cancel_requested, launch=launch, failure=failure)


ATTEMPT_RULES: tuple[Rule, ...] = (
    _attempt_rule("attempt-starts", _on(H.WORKERS_STARTED), _states(A.pending), _attempt(A.running, W.STARTED)),
    _attempt_rule("attempt-already-started", _on(H.WORKERS_STARTED), _states(A.running, _TERMINAL)),
    # an attempt whose end arrives before (or with) its first events is first marked running
    _attempt_rule("succeeds-before-its-first-event", _on(H.ENDED), _states(A.pending),
                  _attempt(A.running, W.STARTED), _attempt(A.succeeded, W.OUTCOME), outcomes=[A.succeeded]),
    _attempt_rule("diverges-before-its-first-event", _on(H.ENDED), _states(A.pending),
                  _attempt(A.running, W.STARTED), _attempt(A.diverged, W.OUTCOME), outcomes=[A.diverged]),
    _attempt_rule("succeeds", _on(H.ENDED), _states(A.running), _attempt(A.succeeded, W.OUTCOME),
                  outcomes=[A.succeeded]),
    _attempt_rule("diverges", _on(H.ENDED), _states(A.running), _attempt(A.diverged, W.OUTCOME),
                  outcomes=[A.diverged]),
    _attempt_rule("crashes", _on(H.ENDED), _states(_UNENDED), _attempt(A.crashed, W.OUTCOME), outcomes=[A.crashed]),
    _attempt_rule("is-cancelled", _on(H.ENDED), _states(_UNENDED), _attempt(A.cancelled, W.OUTCOME),
                  outcomes=[A.cancelled]),
    # a setup error (the preflight probe, the workers' setup) may end an attempt before its first event
    _attempt_rule("cannot-run-as-configured", _on(H.ENDED), _states(_UNENDED), _attempt(A.config_error, W.OUTCOME),
                  outcomes=[A.config_error]),
    _attempt_rule("already-ended", _on(H.ENDED), _states(_TERMINAL)),
    _attempt_rule("fails-to-start", _on(H.START_FAILED), _states(_UNENDED), _attempt(A.crashed, W.EVENT)),
    _attempt_rule("fails-to-start-after-its-end", _on(H.START_FAILED), _states(_TERMINAL)),
    _attempt_rule("cancelled-in-the-queue", _on(H.CANCELLED_IN_QUEUE), _states(_UNENDED),
                  _attempt(A.cancelled, W.EVENT)),
)

RUN_RULES: tuple[Rule, ...] = (
    # ------------------------------------------------------------------ claiming and starting worker groups
    _run_rule("claim", _on(H.CLAIMED), _states(R.queued), _run(R.starting, W.EVENT)),
    _run_rule("claim-a-broken-recipe", _on(H.RECIPE_INVALID), _states(R.queued),
              _run(R.starting, W.CLAIM), _run(R.failed, W.EVENT), failure=F.config_error),
    _run_rule("cancel-in-the-queue", _on(H.CANCELLED_IN_QUEUE), _states(R.queued), _run(R.cancelled, W.EVENT)),
    _run_rule("claim-a-run-that-cannot-fit", _on(H.CANNOT_FIT), _states(R.queued),
              _run(R.starting, W.CLAIM), _run(R.failed, W.EVENT), failure=F.cannot_fit),
    _run_rule("launch-a-new-worker-group", _on(H.LAUNCHING), _states(R.recovering), _run(R.starting, W.EVENT)),
    _run_rule("launch-the-first-worker-group", _on(H.LAUNCHING), _states(R.starting)),
    _run_rule("fail-to-start-while-recovering", _on(H.START_FAILED), _states(R.recovering),
              _run(R.starting, W.EVENT), _run(R.failed, W.EVENT), failure=F.start_failed),
    _run_rule("fail-to-start", _on(H.START_FAILED), _states(R.starting, R.running), _run(R.failed, W.EVENT),
              failure=F.start_failed),
    _run_rule("run-starts", _on(H.WORKERS_STARTED), _states(R.starting), _run(R.running, W.EVENT)),
    _run_rule("run-already-started", _on(H.WORKERS_STARTED), _states(R.running, R.recovering)),
    # ------------------------------------------------------------------ an attempt ended: cancel beats all
    _run_rule("cancelled", _on(H.ENDED), _states(ACTIVE_RUN_STATES), _run(R.cancelled, W.CANCEL),
              outcomes=[A.cancelled]),
    _run_rule("cancel-requested", _on(H.ENDED), _states(ACTIVE_RUN_STATES), _run(R.cancelled, W.CANCEL),
              cancel_requested=True),
    # ------------------------------------------------------------------ a setup error: no retry can fix it
    _run_rule("fail-on-a-config-error", _on(*_ENDINGS), _states(ACTIVE_RUN_STATES), _run(R.failed, W.EVENT),
              outcomes=[A.config_error], failure=F.config_error),
    _run_rule("succeed-while-starting", _on(H.ENDED), _states(R.starting),
              _run(R.running, W.EVENT), _run(R.succeeded, W.EVENT), outcomes=[A.succeeded]),
    _run_rule("succeed", _on(*_ENDINGS), _states(R.running), _run(R.succeeded, W.EVENT), outcomes=[A.succeeded]),
    _run_rule("adopted-a-cancelled-end", _on(H.ADOPTED_ENDED), _states(R.running, R.recovering),
              _run(R.cancelled, W.EVENT), outcomes=[A.cancelled]),
    _run_rule("adopted-an-end-before-the-start", _on(H.ADOPTED_ENDED), _states(R.starting), _run(R.failed, W.EVENT),
              failure=F.lost),
    # ------------------------------------------------------------------ diverged or crashed: the policy decided
    _run_rule("give-up", _on(*_ENDINGS), _states(R.running),
              _run(R.recovering, W.EVENT), _run(R.failed, W.DECISION), decisions=[D.GIVE_UP], failure=F.gave_up),
    _run_rule("give-up-before-running", _on(*_ENDINGS), _states(R.starting, R.recovering),
              _run(R.failed, W.DECISION), decisions=[D.GIVE_UP], failure=F.gave_up),
    _run_rule("retry", _on(*_ENDINGS), _states(R.running),
              _run(R.recovering, W.EVENT), _next(A.pending, W.DECISION), decisions=[D.RETRY], launch=True),
    _run_rule("retry-while-recovering", _on(*_ENDINGS), _states(R.recovering),
              _next(A.pending, W.DECISION), decisions=[D.RETRY], launch=True),
    # it never got running (died while starting): it waits in the queue for room like any run
    _run_rule("requeue-a-run-that-never-ran", _on(H.ENDED), _states(R.starting),
              _next(A.pending, W.DECISION), _run(R.queued, W.DECISION), decisions=[D.RETRY]),
    _run_rule("retry-in-place", _on(H.ENDED), _states(R.running),
              _run(R.recovering, W.EVENT), _next(A.pending, W.DECISION), _next(A.running, W.IN_PLACE),
              _run(R.running, W.DECISION), decisions=[D.IN_PLACE]),
    _run_rule("retry-in-place-while-recovering", _on(H.ENDED), _states(R.recovering),
              _next(A.pending, W.DECISION), _next(A.running, W.IN_PLACE), _run(R.running, W.DECISION),
              decisions=[D.IN_PLACE]),
    # ------------------------------------------------------------------ adopted from a dead scheduler
    _run_rule("adopted-without-an-attempt", _on(H.ADOPTED_EMPTY), _states(ACTIVE_RUN_STATES),
              _run(R.failed, W.EVENT), failure=F.lost),
    _run_rule("adopted-an-unstarted-attempt-while-running", _on(H.ADOPTED_UNSTARTED), _states(R.running),
              _run(R.recovering, W.EVENT), launch=True),
    _run_rule("adopted-an-unstarted-attempt", _on(H.ADOPTED_UNSTARTED), _states(R.starting, R.recovering),
              launch=True),
    # ------------------------------------------------------------------ a person's request
    _run_rule("retry-on-request", _on(H.RETRY_REQUESTED), _states(R.failed, R.cancelled),
              _next(A.pending, W.EVENT), _run(R.queued, W.EVENT)),
)

RULES: tuple[Rule, ...] = ATTEMPT_RULES + RUN_RULES


def first_rule(rules: Sequence[Rule], situation: Situation) -> Rule | None:
    """The first of ``rules`` that matches (None if none does)."""
    return next((r for r in rules if r.matches(situation)), None)


def resolve(situation: Situation) -> Resolution:
    """The hops ``situation`` causes: the attempt's facet (when ``situation.attempt`` is set), then the run's
    (when ``situation.run`` is set). Raises :class:`NoRule` for a facet no rule covers."""
    fired: list[Rule] = []
    for facet, rules, state in ((Entity.ATTEMPT, ATTEMPT_RULES, situation.attempt),
                                (Entity.RUN, RUN_RULES, situation.run)):
        if state is None:
            continue
        rule = first_rule(rules, situation)
        if rule is None:
            raise NoRule(facet, situation)
        fired.append(rule)
    return Resolution(
        rules=tuple(r.name for r in fired),
        hops=tuple(h for r in fired for h in r.hops),
        launch=any(r.launch for r in fired),
        failure=next((r.failure for r in fired if r.failure is not None), None),
    )
