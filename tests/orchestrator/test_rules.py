"""The outcome → transitions rules, table-tested: for every rule one situation it handles and the hops it yields.

The expected hops are written out here (not derived from the table) so that changing what an outcome means is a
visible edit to this file too. Further checks: every rule appears in the table below, every path a rule takes is
legal under the state machines, and situations no rule covers fail loudly.
"""

from __future__ import annotations

import pytest

from orchestrator.policy.rules import (
    ATTEMPT_RULES,
    FIXED_NOTES,
    RULES,
    RUN_RULES,
    Decision,
    Entity,
    Happening,
    Hop,
    NoRule,
    Rule,
    Situation,
    Why,
    resolve,
)
from orchestrator.policy.states import (
    ACTIVE_RUN_STATES,
    TERMINAL_ATTEMPT_STATES,
    AttemptState,
    FailureKind,
    RunState,
    check_attempt_transition,
    check_run_transition,
)

R, A, H, D, W = RunState, AttemptState, Happening, Decision, Why


def run(to: RunState, why: Why) -> Hop:
    return Hop(Entity.RUN, to, why)


def attempt(to: AttemptState, why: Why) -> Hop:
    return Hop(Entity.ATTEMPT, to, why)


def nxt(to: AttemptState, why: Why) -> Hop:
    return Hop(Entity.NEXT, to, why)


# (situation, the rule expected to fire, its hops, launch); one row per rule, more where the order matters
CASES: list[tuple[Situation, str, tuple[Hop, ...], bool]] = [
    # ------------------------------------------------------------------------------------------ attempt facet
    (Situation(H.WORKERS_STARTED, attempt=A.pending), "attempt-starts", (attempt(A.running, W.STARTED),), False),
    (Situation(H.WORKERS_STARTED, attempt=A.running), "attempt-already-started", (), False),
    (Situation(H.WORKERS_STARTED, attempt=A.diverged), "attempt-already-started", (), False),
    (Situation(H.ENDED, attempt=A.pending, outcome=A.succeeded), "succeeds-before-its-first-event",
     (attempt(A.running, W.STARTED), attempt(A.succeeded, W.OUTCOME)), False),
    (Situation(H.ENDED, attempt=A.pending, outcome=A.diverged), "diverges-before-its-first-event",
     (attempt(A.running, W.STARTED), attempt(A.diverged, W.OUTCOME)), False),
    (Situation(H.ENDED, attempt=A.running, outcome=A.succeeded), "succeeds",
     (attempt(A.succeeded, W.OUTCOME),), False),
    (Situation(H.ENDED, attempt=A.running, outcome=A.diverged), "diverges", (attempt(A.diverged, W.OUTCOME),), False),
    (Situation(H.ENDED, attempt=A.running, outcome=A.crashed), "crashes", (attempt(A.crashed, W.OUTCOME),), False),
    (Situation(H.ENDED, attempt=A.pending, outcome=A.crashed), "crashes", (attempt(A.crashed, W.OUTCOME),), False),
    (Situation(H.ENDED, attempt=A.running, outcome=A.cancelled), "is-cancelled",
     (attempt(A.cancelled, W.OUTCOME),), False),
    (Situation(H.ENDED, attempt=A.pending, outcome=A.cancelled), "is-cancelled",
     (attempt(A.cancelled, W.OUTCOME),), False),
    (Situation(H.ENDED, attempt=A.pending, outcome=A.config_error), "cannot-run-as-configured",
     (attempt(A.config_error, W.OUTCOME),), False),
    (Situation(H.ENDED, attempt=A.running, outcome=A.config_error), "cannot-run-as-configured",
     (attempt(A.config_error, W.OUTCOME),), False),
    (Situation(H.ENDED, attempt=A.diverged, outcome=A.cancelled), "already-ended", (), False),
    (Situation(H.START_FAILED, attempt=A.pending), "fails-to-start", (attempt(A.crashed, W.EVENT),), False),
    (Situation(H.START_FAILED, attempt=A.crashed), "fails-to-start-after-its-end", (), False),
    (Situation(H.CANCELLED_IN_QUEUE, attempt=A.pending), "cancelled-in-the-queue",
     (attempt(A.cancelled, W.EVENT),), False),
    # ---------------------------------------------------------------------------------------------- run facet
    (Situation(H.CLAIMED, run=R.queued), "claim", (run(R.starting, W.EVENT),), False),
    (Situation(H.RECIPE_INVALID, run=R.queued), "claim-a-broken-recipe",
     (run(R.starting, W.CLAIM), run(R.failed, W.EVENT)), False),
    (Situation(H.CANCELLED_IN_QUEUE, run=R.queued), "cancel-in-the-queue", (run(R.cancelled, W.EVENT),), False),
    (Situation(H.CANNOT_FIT, run=R.queued), "claim-a-run-that-cannot-fit",
     (run(R.starting, W.CLAIM), run(R.failed, W.EVENT)), False),
    (Situation(H.LAUNCHING, run=R.recovering), "launch-a-new-worker-group", (run(R.starting, W.EVENT),), False),
    (Situation(H.LAUNCHING, run=R.starting), "launch-the-first-worker-group", (), False),
    (Situation(H.START_FAILED, run=R.recovering), "fail-to-start-while-recovering",
     (run(R.starting, W.EVENT), run(R.failed, W.EVENT)), False),
    (Situation(H.START_FAILED, run=R.starting), "fail-to-start", (run(R.failed, W.EVENT),), False),
    (Situation(H.WORKERS_STARTED, run=R.starting), "run-starts", (run(R.running, W.EVENT),), False),
    (Situation(H.WORKERS_STARTED, run=R.running), "run-already-started", (), False),
    (Situation(H.ENDED, run=R.running, outcome=A.cancelled), "cancelled", (run(R.cancelled, W.CANCEL),), False),
    # a requested cancel wins over every other outcome, also over a success
    (Situation(H.ENDED, run=R.running, outcome=A.succeeded, cancel_requested=True), "cancel-requested",
     (run(R.cancelled, W.CANCEL),), False),
    (Situation(H.ENDED, run=R.starting, outcome=A.crashed, cancel_requested=True), "cancel-requested",
     (run(R.cancelled, W.CANCEL),), False),
    # a setup error fails the run whatever state it is in (the preflight: starting; the workers: running)
    (Situation(H.ENDED, run=R.starting, outcome=A.config_error), "fail-on-a-config-error",
     (run(R.failed, W.EVENT),), False),
    (Situation(H.ENDED, run=R.running, outcome=A.config_error), "fail-on-a-config-error",
     (run(R.failed, W.EVENT),), False),
    (Situation(H.ADOPTED_ENDED, run=R.recovering, outcome=A.config_error), "fail-on-a-config-error",
     (run(R.failed, W.EVENT),), False),
    (Situation(H.ENDED, run=R.starting, outcome=A.config_error, cancel_requested=True), "cancel-requested",
     (run(R.cancelled, W.CANCEL),), False),
    (Situation(H.ENDED, run=R.starting, outcome=A.succeeded), "succeed-while-starting",
     (run(R.running, W.EVENT), run(R.succeeded, W.EVENT)), False),
    (Situation(H.ENDED, run=R.running, outcome=A.succeeded), "succeed", (run(R.succeeded, W.EVENT),), False),
    (Situation(H.ADOPTED_ENDED, run=R.running, outcome=A.succeeded), "succeed", (run(R.succeeded, W.EVENT),), False),
    (Situation(H.ADOPTED_ENDED, run=R.recovering, outcome=A.cancelled), "adopted-a-cancelled-end",
     (run(R.cancelled, W.EVENT),), False),
    (Situation(H.ADOPTED_ENDED, run=R.starting, outcome=A.diverged, decision=D.RETRY),
     "adopted-an-end-before-the-start", (run(R.failed, W.EVENT),), False),
    (Situation(H.ENDED, run=R.running, outcome=A.diverged, decision=D.GIVE_UP), "give-up",
     (run(R.recovering, W.EVENT), run(R.failed, W.DECISION)), False),
    (Situation(H.ADOPTED_ENDED, run=R.running, outcome=A.crashed, decision=D.GIVE_UP), "give-up",
     (run(R.recovering, W.EVENT), run(R.failed, W.DECISION)), False),
    (Situation(H.ENDED, run=R.starting, outcome=A.crashed, decision=D.GIVE_UP), "give-up-before-running",
     (run(R.failed, W.DECISION),), False),
    (Situation(H.ENDED, run=R.running, outcome=A.diverged, decision=D.RETRY), "retry",
     (run(R.recovering, W.EVENT), nxt(A.pending, W.DECISION)), True),
    (Situation(H.ADOPTED_ENDED, run=R.recovering, outcome=A.crashed, decision=D.RETRY), "retry-while-recovering",
     (nxt(A.pending, W.DECISION),), True),
    (Situation(H.ENDED, run=R.starting, outcome=A.crashed, decision=D.RETRY), "requeue-a-run-that-never-ran",
     (nxt(A.pending, W.DECISION), run(R.queued, W.DECISION)), False),
    (Situation(H.ENDED, run=R.running, outcome=A.diverged, decision=D.IN_PLACE), "retry-in-place",
     (run(R.recovering, W.EVENT), nxt(A.pending, W.DECISION), nxt(A.running, W.IN_PLACE),
      run(R.running, W.DECISION)), False),
    (Situation(H.ENDED, run=R.recovering, outcome=A.diverged, decision=D.IN_PLACE), "retry-in-place-while-recovering",
     (nxt(A.pending, W.DECISION), nxt(A.running, W.IN_PLACE), run(R.running, W.DECISION)), False),
    (Situation(H.ADOPTED_EMPTY, run=R.recovering), "adopted-without-an-attempt", (run(R.failed, W.EVENT),), False),
    (Situation(H.ADOPTED_UNSTARTED, run=R.running), "adopted-an-unstarted-attempt-while-running",
     (run(R.recovering, W.EVENT),), True),
    (Situation(H.ADOPTED_UNSTARTED, run=R.starting), "adopted-an-unstarted-attempt", (), True),
    (Situation(H.RETRY_REQUESTED, run=R.failed), "retry-on-request",
     (nxt(A.pending, W.EVENT), run(R.queued, W.EVENT)), False),
    (Situation(H.RETRY_REQUESTED, run=R.cancelled), "retry-on-request",
     (nxt(A.pending, W.EVENT), run(R.queued, W.EVENT)), False),
]


@pytest.mark.parametrize(("situation", "name", "hops", "launch"), CASES,
                         ids=[f"{c[1]}:{i}" for i, c in enumerate(CASES)])
def test_each_rule(situation: Situation, name: str, hops: tuple[Hop, ...], launch: bool) -> None:
    got = resolve(situation)
    assert got.rules == (name,)
    assert got.hops == hops
    assert got.launch is launch


def test_every_rule_is_in_the_table_and_names_are_unique() -> None:
    names = [r.name for r in RULES]
    assert len(names) == len(set(names))
    assert {c[1] for c in CASES} == set(names)


def _legal_path(entity: Entity, start: str, hops: tuple[Hop, ...]) -> None:
    state = start
    for hop in hops:
        if hop.entity is not entity:
            continue
        (check_run_transition if entity is Entity.RUN else check_attempt_transition)(state, hop.to)
        state = hop.to.value


@pytest.mark.parametrize("rule", RULES, ids=[r.name for r in RULES])
def test_every_path_is_legal_from_every_state_it_handles(rule: Rule) -> None:
    for start in rule.from_states:
        _legal_path(rule.facet, start, rule.hops)
        # the next attempt is created pending, then moves on legally
        _legal_path(Entity.NEXT, A.pending.value, tuple(h for h in rule.hops if h.to is not A.pending))


def test_a_run_rule_never_moves_the_attempt_and_an_attempt_rule_never_the_run() -> None:
    assert all(h.entity is not Entity.ATTEMPT for r in RUN_RULES for h in r.hops)
    assert all(h.entity is Entity.ATTEMPT for r in ATTEMPT_RULES for h in r.hops)
    assert all(r.facet is Entity.RUN for r in RUN_RULES) and all(r.facet is Entity.ATTEMPT for r in ATTEMPT_RULES)


def test_both_facets_resolve_together_attempt_first() -> None:
    got = resolve(Situation(H.ENDED, run=R.running, attempt=A.running, outcome=A.diverged, decision=D.RETRY))
    assert got.rules == ("diverges", "retry")
    assert got.hops == (attempt(A.diverged, W.OUTCOME), run(R.recovering, W.EVENT), nxt(A.pending, W.DECISION))
    assert got.launch
    got = resolve(Situation(H.WORKERS_STARTED, run=R.starting, attempt=A.pending))
    assert got.hops == (attempt(A.running, W.STARTED), run(R.running, W.EVENT))
    assert resolve(Situation(H.CLAIMED)).hops == ()  # no facet given: nothing to resolve


@pytest.mark.parametrize("situation", [
    Situation(H.CLAIMED, run=R.running),  # only a queued run is claimed
    Situation(H.ENDED, run=R.running, outcome=A.diverged),  # diverged, but nobody asked the policy
    Situation(H.ENDED, run=R.recovering, outcome=A.succeeded),  # a success while recovering: never happens
    Situation(H.LAUNCHING, run=R.running),
    Situation(H.RETRY_REQUESTED, run=R.succeeded),
    Situation(H.WORKERS_STARTED, run=R.succeeded),
    Situation(H.START_FAILED, run=R.queued),
], ids=str)
def test_a_situation_no_rule_covers_fails_loudly(situation: Situation) -> None:
    with pytest.raises(NoRule):
        resolve(situation)


def test_the_cancel_rules_cover_every_active_state_and_outcome() -> None:
    for state in ACTIVE_RUN_STATES:
        for outcome in TERMINAL_ATTEMPT_STATES:
            for decision in Decision:
                got = resolve(Situation(H.ENDED, run=state, outcome=outcome, decision=decision,
                                        cancel_requested=True))
                assert got.hops == (run(R.cancelled, W.CANCEL),)


FAILURES: dict[str, FailureKind] = {
    "claim-a-broken-recipe": FailureKind.config_error,
    "fail-on-a-config-error": FailureKind.config_error,
    "fail-to-start-while-recovering": FailureKind.start_failed,
    "fail-to-start": FailureKind.start_failed,
    "adopted-an-end-before-the-start": FailureKind.lost,
    "adopted-without-an-attempt": FailureKind.lost,
    "give-up": FailureKind.gave_up,
    "give-up-before-running": FailureKind.gave_up,
    "claim-a-run-that-cannot-fit": FailureKind.cannot_fit,
}
"""The kind each rule that fails a run records (``runs.failure_kind``)."""


def test_every_rule_that_fails_a_run_names_its_kind_and_no_other_does() -> None:
    fails = {r.name: r.failure for r in RUN_RULES if any(h.to is R.failed for h in r.hops)}
    assert fails == FAILURES
    assert all(r.failure is None for r in RULES if r.name not in FAILURES)


@pytest.mark.parametrize(("situation", "kind"), [
    (Situation(H.ENDED, run=R.starting, attempt=A.pending, outcome=A.config_error), FailureKind.config_error),
    (Situation(H.ENDED, run=R.running, attempt=A.running, outcome=A.crashed, decision=D.GIVE_UP),
     FailureKind.gave_up),
    (Situation(H.START_FAILED, run=R.starting, attempt=A.pending), FailureKind.start_failed),
    (Situation(H.ENDED, run=R.running, attempt=A.running, outcome=A.crashed, decision=D.RETRY), None),
], ids=str)
def test_the_resolution_carries_the_failure_kind(situation: Situation, kind: FailureKind | None) -> None:
    assert resolve(situation).failure is kind


def test_a_config_error_is_never_retried() -> None:
    """Whatever the policy would say, a config error fails the run (no crash restart, no numeric retry)."""
    for state in ACTIVE_RUN_STATES:
        for decision in Decision:
            got = resolve(Situation(H.ENDED, run=state, attempt=A.running, outcome=A.config_error,
                                    decision=decision))
            assert got.rules == ("cannot-run-as-configured", "fail-on-a-config-error")
            assert not got.launch and all(h.entity is not Entity.NEXT for h in got.hops)


def test_fixed_notes() -> None:
    assert FIXED_NOTES[W.STARTED].reason == "workers started"
    assert FIXED_NOTES[W.CANCEL].reason == "cancelled on request"
