"""The recovery loop of ``ballast train``: attempts in this process (or a local Ray Train run each), judged by the
same pure policy the orchestrator applies (``orchestrator.policy.recovery.decide``), until one succeeds or the
policy gives up.

The service builds the policy's records from its store (``orchestrator/store/records.py``); here they are built
from what each attempt reported to its sink (the ``checkpoint`` events with their health verdicts and smoothed
losses) and from its ``end`` event, so a recipe's promised retry happens on a laptop exactly as it would on the
service: the same checkpoint, the same tightened settings, the same re-warm and data offset. The attempt itself
is run by an ``AttemptRunner`` (in-process or Ray Train); this module holds the one loop both share.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from contracts.checkpoint import CorruptCheckpoint, local_dir, read_manifest, verify_checkpoint
from contracts.export import ExportTargets
from contracts.overrides import apply_overrides
from contracts.recipe import Recipe, RecipeError
from contracts.wire import AttemptSpec, EndEvent, finite_or_none, one_line
from orchestrator.policy.probe import apply_probe_result
from orchestrator.policy.recovery import AttemptRecord, CheckpointRecord, GiveUp, RecoveryPlan, decide

RECOVERABLE = ("diverged", "crashed")
MAX_POLICY_ROUNDS = 8
"""Times the policy is asked again after the checkpoint it chose failed verification (as the scheduler does)."""


class ListSink(Protocol):
    """What the loop needs of an attempt's sink (``workers.sinks.ListSink`` is one): the events it kept, and the
    flag that asks the attempt to stop."""

    stop_requested: bool

    def of_type(self, type: str) -> list[dict[str, Any]]: ...


class AttemptCrashed(Exception):
    """An attempt died without an ``end`` event (an injected crash, a failed worker group): a crash to the policy."""


@dataclass
class Ended:
    """How one attempt ended, as a runner reports it: the outcome, its ``end`` event (None for a crash) and the
    attempt's result document (``AttemptOutcome.to_dict()`` or the same keys rebuilt from the sink)."""

    outcome: str
    end: EndEvent | None
    result: dict[str, Any]
    error: str | None = None


class AttemptRunner(Protocol):
    def __call__(self, spec: AttemptSpec, sink: ListSink) -> Ended:
        """Run one attempt to its end; raise ``AttemptCrashed`` when it dies without reporting an end."""
        ...


@dataclass
class LocalAttempt:
    """One attempt of a local run: how it started (the policy's plan) and how it ended."""

    number: int
    kind: str
    spec: AttemptSpec
    start_step: int = 0
    resumed_from: CheckpointRecord | None = None
    overrides: dict[str, list[Any]] = field(default_factory=dict)
    """Cumulative diff against the recipe: ``{"optimizer.lr": [old, new]}``."""
    reason: str = ""
    """Why it started (the policy's reason; empty for the first attempt)."""
    ended: Ended | None = None
    lr_probe: dict[str, Any] | None = None
    """The LR probe it ran before training: the plan's candidates and what the probe chose (None: no probe)."""
    decision: str | None = None
    """What followed it: the next attempt's reason or why the policy gave up (None: it succeeded/was cancelled)."""

    @property
    def outcome(self) -> str:
        return self.ended.outcome if self.ended is not None else "pending"

    def record(self) -> AttemptRecord:
        """The policy's view of this (ended) attempt, as ``orchestrator.store.records.attempt_record`` builds it."""
        assert self.ended is not None
        end = self.ended.end
        return AttemptRecord(
            number=self.number, kind=self.kind, outcome=self.ended.outcome, start_step=self.start_step,
            onset_step=end.onset_step if end is not None else None,
            final_step=end.final_step if end is not None else self.ended.result.get("final_step"),
            detector=end.detector if end is not None else None,
            value=end.value if end is not None else None,
            overrides=self.overrides, data_offset=self.spec.data_offset,
            loss_scale_collapsed=end.loss_scale_collapsed if end is not None else False,
            median_grad_norm=end.median_grad_norm if end is not None else None,
            error=self.ended.error,
            resumed_from_id=self.resumed_from.id if self.resumed_from is not None else None,
            rewarm_steps=self.spec.rewarm_steps,
            pending_probe=self.spec.lr_probe if self.lr_probe is None else None,  # lr_probe: the probe's result
            probe_steps=int((self.lr_probe or {}).get("steps_run") or 0),
        )

    def to_dict(self, checkpoints: Sequence[CheckpointRecord]) -> dict[str, Any]:
        end = self.ended.end if self.ended is not None else None
        result = self.ended.result if self.ended is not None else {}
        parent = self.resumed_from
        return {
            "number": self.number,
            "kind": self.kind,
            "outcome": self.outcome,
            "start_step": self.start_step,
            "final_step": result.get("final_step"),
            "onset_step": end.onset_step if end is not None else None,
            "detector": end.detector if end is not None else None,
            "error": self.ended.error if self.ended is not None else None,
            "resumed_from": None if parent is None else {"attempt": parent.attempt_number, "step": parent.step,
                                                         "uri": parent.uri, "healthy": parent.healthy},
            "overrides": self.overrides,
            "rewarm_steps": self.spec.rewarm_steps,
            "data_offset": self.spec.data_offset,
            "reason": self.reason,
            "lr_probe": self.lr_probe,
            "decision": self.decision,
            "checkpoints": [{"step": c.step, "uri": c.uri, "healthy": c.healthy, "valid": c.valid}
                            for c in checkpoints if c.attempt_number == self.number],
        }


@dataclass
class LocalOutcome:
    """The whole local run: every attempt, oldest first, and why it stopped."""

    attempts: list[LocalAttempt]
    checkpoints: list[CheckpointRecord]
    gave_up: str | None = None

    @property
    def last(self) -> LocalAttempt:
        return self.attempts[-1]

    @property
    def outcome(self) -> str:
        return self.last.outcome

    def to_dict(self) -> dict[str, Any]:
        """The last attempt's result (its losses, checkpoints, findings) with the run's attempts on top."""
        last = self.last.ended.result if self.last.ended is not None else {}
        return {
            **last,
            "outcome": self.outcome,
            "gave_up": self.gave_up,
            "attempts": [a.to_dict(self.checkpoints) for a in self.attempts],
        }


class LocalRun:
    """Runs a recipe's attempts with ``runner`` under the recovery policy. ``recipe`` is the run's recipe (the
    policy's overrides are a diff against it); attempt N writes its checkpoints under ``root/attempt-N``."""

    def __init__(
        self,
        recipe: Recipe,
        root: Path,
        runner: AttemptRunner,
        *,
        make_sink: Callable[[AttemptSpec, int], ListSink],
        allowed_import_modules: Sequence[str] = (),
        export: ExportTargets | None = None,
        on_start: Callable[[LocalAttempt], None] | None = None,
        on_end: Callable[[LocalAttempt], None] | None = None,
    ) -> None:
        self.recipe = recipe
        self.root = root
        self.runner = runner
        self.make_sink = make_sink
        self.allowed = list(allowed_import_modules)
        self.export = export if recipe.telemetry.export else None
        """Where the tracker export writes (as the scheduler sends it), so a Ray worker writes where this process
        says rather than where its own environment would."""
        self.on_start = on_start
        self.on_end = on_end
        self.checkpoints: list[CheckpointRecord] = []
        self._sha: dict[int, str | None] = {}
        """Checkpoint id → the manifest digest its event reported (verified before a resume)."""
        self.attempts: list[LocalAttempt] = []
        self.sink: ListSink | None = None
        self.stop_requested = False

    def request_stop(self) -> None:
        """Stop the current attempt after its step and start no other (the first Ctrl-C)."""
        self.stop_requested = True
        if self.sink is not None:
            self.sink.stop_requested = True

    # ------------------------------------------------------------------------------------------------- loop
    def run(self, resume: str | None = None) -> LocalOutcome:
        """Attempt 1 (from ``resume`` when given), then the policy's attempts until success, cancel or give-up."""
        attempt = self._first(resume)
        while True:
            self._run(attempt)
            decision: RecoveryPlan | GiveUp | None = None
            if attempt.outcome in RECOVERABLE and not self.stop_requested:
                decision = self._decide()
                attempt.decision = decision.reason
            if self.on_end is not None:
                self.on_end(attempt)
            if decision is None:
                return LocalOutcome(self.attempts, self.checkpoints)
            if isinstance(decision, GiveUp):
                return LocalOutcome(self.attempts, self.checkpoints, gave_up=decision.reason)
            attempt = self._next(decision)

    def _first(self, resume: str | None) -> LocalAttempt:
        start, parent = 0, None
        if resume is not None:
            manifest = read_manifest(resume)  # CorruptCheckpoint names the problem
            parent = CheckpointRecord(id=1, attempt_number=0, step=manifest.step, uri=str(resume),
                                      healthy=manifest.healthy)
            self.checkpoints.append(parent)
            start = manifest.step
        spec = AttemptSpec(recipe=self.recipe, checkpoint_dir=str(self.root / "attempt-1"), attempt=1,
                           resume_from=resume, allowed_import_modules=self.allowed, export=self.export)
        return LocalAttempt(number=1, kind="initial", spec=spec, start_step=start, resumed_from=parent)

    def _run(self, attempt: LocalAttempt) -> None:
        self.attempts.append(attempt)
        if self.on_start is not None:
            self.on_start(attempt)
        sink = self.sink = self.make_sink(attempt.spec, attempt.start_step)
        sink.stop_requested = self.stop_requested
        try:
            attempt.ended = self.runner(attempt.spec, sink)
        except AttemptCrashed as exc:
            attempt.ended = Ended("crashed", None, result_from_sink(sink, "crashed", attempt.start_step),
                                  error=one_line(exc))
            attempt.ended.result["error"] = attempt.ended.error
        finally:
            self.sink = None
            self._add_checkpoints(attempt.number, sink)
            for probed in sink.of_type("lr_probe"):
                self._record_probe(attempt, probed)
        if attempt.ended.end is not None and attempt.ended.end.lr_probe is not None:
            self._record_probe(attempt, attempt.ended.end.lr_probe)  # a runner whose sink kept no such event
        attempt.ended.result["start_step"] = attempt.start_step

    @staticmethod
    def _record_probe(attempt: LocalAttempt, probed: Mapping[str, Any]) -> None:
        """What the attempt's LR probe chose becomes its settings, as the service's ingest records it."""
        planned = None if attempt.spec.lr_probe is None else attempt.spec.lr_probe.to_dict()
        probe = attempt.lr_probe if attempt.lr_probe is not None else planned
        plan_before: dict[str, Any] = {"rewarm_steps": attempt.spec.rewarm_steps}
        if probe is not None:
            plan_before["lr_probe"] = probe
        applied = apply_probe_result(attempt.overrides, plan_before, attempt.reason, probed)
        if applied is not None:
            attempt.overrides, plan, attempt.reason = applied
            attempt.lr_probe = plan["lr_probe"]
            if plan["rewarm_steps"] == 0:  # a clean pick: the attempt trained without its re-warm
                attempt.spec = replace(attempt.spec, rewarm_steps=0)

    def _add_checkpoints(self, number: int, sink: ListSink) -> None:
        for event in sink.of_type("checkpoint"):
            metrics = event.get("metrics") or {}
            loss = metrics.get("smoothed_loss")
            self.checkpoints.append(CheckpointRecord(
                id=len(self.checkpoints) + 1, attempt_number=number, step=int(event["step"]), uri=str(event["uri"]),
                healthy=bool(event["healthy"]),
                loss=finite_or_none(float(loss)) if isinstance(loss, int | float) else None,
            ))
            self._sha[len(self.checkpoints)] = str(event.get("sha256") or "") or None

    def _decide(self) -> RecoveryPlan | GiveUp:
        """``decide`` over the history so far; a chosen checkpoint that fails verification (or that retention
        removed) is marked invalid and the policy asked again, as the scheduler does."""
        history = [a.record() for a in self.attempts]
        self._mark_missing()
        for _ in range(MAX_POLICY_ROUNDS):
            try:
                decision = decide(self.recipe, history, self.checkpoints)
            except (ValueError, RecipeError) as exc:
                return GiveUp(f"the recovery policy could not decide: {one_line(exc)}")
            if not isinstance(decision, RecoveryPlan) or decision.resume_from is None:
                return decision
            chosen = decision.resume_from
            problem = self._problem(chosen)
            if problem is None:
                return decision
            self._invalidate(chosen.id)
        return GiveUp("no usable checkpoint: every candidate failed verification")

    def _problem(self, ckpt: CheckpointRecord) -> str | None:
        path = local_dir(ckpt.uri)
        if path is None:
            return None  # a remote URI: the worker's verified load checks it
        try:
            verify_checkpoint(path, expected_sha256=self._sha.get(ckpt.id))
        except CorruptCheckpoint as exc:
            return exc.reason
        return None

    def _mark_missing(self) -> None:
        """Checkpoints removed by retention since they were written can no longer be resumed."""
        for c in list(self.checkpoints):
            path = local_dir(c.uri)
            if c.valid and path is not None and not path.is_dir():
                self._invalidate(c.id)

    def _invalidate(self, ckpt_id: int) -> None:
        self.checkpoints = [replace(c, valid=False) if c.id == ckpt_id else c for c in self.checkpoints]

    def _next(self, plan: RecoveryPlan) -> LocalAttempt:
        number = len(self.attempts) + 1
        overrides = plan.overrides_json()
        recipe = apply_overrides(self.recipe, overrides, allowed_import_modules=self.allowed or None)
        spec = AttemptSpec(
            recipe=recipe, checkpoint_dir=str(self.root / f"attempt-{number}"), attempt=number,
            resume_from=plan.resume_from.uri if plan.resume_from is not None else None,
            rewarm_steps=plan.rewarm_steps, data_offset=plan.data_offset, allowed_import_modules=self.allowed,
            export=self.export, lr_probe=plan.lr_probe,
        )
        return LocalAttempt(number=number, kind=plan.kind, spec=spec, start_step=plan.resume_step,
                            resumed_from=plan.resume_from, overrides=overrides, reason=plan.reason)


def result_from_sink(
    sink: ListSink, outcome: str, start_step: int = 0, end: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """An attempt's result document rebuilt from the events its sink received and its ``end`` event data (Ray
    Train runs, crashes); the loop sets ``start_step`` from the plan."""
    metrics = sink.of_type("metric")
    final = int(metrics[-1]["step"]) + 1 if metrics else start_step
    return {
        "outcome": outcome,
        "start_step": start_step,
        "final_step": final,
        **(end or {}),
        "losses": [finite_or_none(m["loss"]) if isinstance(m.get("loss"), int | float) else None for m in metrics],
        "findings": sink.of_type("anomaly"),
        "evals": sink.of_type("eval"),
        "checkpoints": [{"step": c["step"], "path": c["uri"], "healthy": c["healthy"]}
                        for c in sink.of_type("checkpoint")],
        "skipped_steps": [m["step"] for m in metrics if m.get("skipped")],
    }
