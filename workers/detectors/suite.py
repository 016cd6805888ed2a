"""All detectors of a recipe, observed once per step in a fixed order, with one combined decision."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from contracts.recipe import (
    Action,
    Detectors,
)
from workers.detectors.base import STATE_VERSION, Decision, Detector, Finding, StepSignals, stronger
from workers.detectors.grad_norm import GradNormSpike
from workers.detectors.loss import LossSpike, LossSummary
from workers.detectors.nonfinite import NonFinite
from workers.detectors.oscillation import Oscillation
from workers.detectors.stagnation import Stagnation
from workers.detectors.vanishing import Vanishing


class DetectorSuite:
    """All detectors of a recipe, observed once per step, in a fixed order, with one combined decision."""

    def __init__(self, cfg: Detectors, *, fp16: bool = False) -> None:
        self.cfg = cfg
        self.fp16 = fp16
        self.nonfinite = NonFinite(cfg.nonfinite, fp16)
        self.grad_norm_spike = GradNormSpike(cfg.grad_norm_spike)
        self.loss_spike = LossSpike(cfg.loss_spike)
        self.vanishing = Vanishing(cfg.vanishing)
        self.stagnation = Stagnation(cfg.stagnation)
        self.oscillation = Oscillation(cfg.oscillation)
        # nonfinite is always present: its skip is the guard that keeps non-finite grads out of the weights
        self._detectors: list[Detector] = [self.nonfinite] + [
            d
            for d in (self.grad_norm_spike, self.loss_spike, self.vanishing, self.stagnation, self.oscillation)
            if d.enabled
        ]
        self.skipped_steps: deque[int] = deque()
        self.last_finding_step: int | None = None
        self.spike_run_last: int | None = None
        """The last step of the current run of consecutive finite ``skip_step`` decisions (None: the last step was
        not one): ``_recurring_spike_bound``."""

    def observe(self, s: StepSignals) -> Decision:
        findings: list[Finding] = []

        def emit(det: Detector, kind: str, value: float | None, threshold: float | None, action: Action,
                 onset: int | None, details: dict[str, Any]) -> None:
            findings.append(Finding(
                step=s.step, kind=kind, detector=det.name, value=value, threshold=threshold, action=Action(action),
                details={**details, "onset_step": s.step if onset is None else onset, "config": det.config},
                rank=s.rank,
            ))

        for det in self._detectors:
            det.evaluate(s, emit)
        action = Action.record
        for f in findings:
            action = stronger(action, f.action)

        absorb = action is Action.record
        clip_to = None
        if action is Action.skip_step:
            cfg = self.cfg
            self.skipped_steps.append(s.step)
            while self.skipped_steps and self.skipped_steps[0] <= s.step - cfg.skip_window:
                self.skipped_steps.popleft()
            if len(self.skipped_steps) > cfg.max_skipped_steps:
                findings.append(Finding(
                    step=s.step, kind="skip_escalation", detector="skip_escalation",
                    value=float(len(self.skipped_steps)), threshold=float(cfg.max_skipped_steps),
                    action=Action.rollback, rank=s.rank,
                    details={"onset_step": self.skipped_steps[0], "skipped_steps": list(self.skipped_steps),
                             "config": {"max_skipped_steps": cfg.max_skipped_steps, "skip_window": cfg.skip_window}},
                ))
                action = Action.rollback
            clip_to = self._recurring_spike_bound(s)
            if clip_to is not None:
                for f in findings:
                    if f.action is Action.skip_step:
                        f.details["applied_clipped_to"] = clip_to
        self.spike_run_last = s.step if action is Action.skip_step and s.finite else None

        for det in self._detectors:
            det.commit(absorb)
        if findings:
            self.last_finding_step = s.step
        # the onset that matters is that of the findings that decided the action (a rollback's, not a record's)
        onset = min((int(f.details["onset_step"]) for f in findings if f.action is action), default=None)
        return Decision(findings=findings, action=action, onset_step=onset, clip_to=clip_to)

    def _recurring_spike_bound(self, s: StepSignals) -> float | None:
        """The norm to clip this step's gradient to and apply it, or None to skip it as the detectors say.

        The first step of a run of consecutive finite skips is skipped: the batch gets the benefit of the doubt.
        A skipped update leaves the weights as they were, so when the next step must be skipped too, a second,
        different batch spiked at the same weights: the cause is the weights, not the batch, and skipping more
        batches cannot move them. So the second and later steps of the run are applied, their gradient clipped to
        the healthy level (the grad-norm EMA's), which bounds the update whatever the recipe's clipping. They still
        count towards the skip escalation, so a spike that persists is rolled back as before. Seen on an H200
        (BENCHMARKS.md, "The CUDA paths"): a single x10 step on a plateau that skipping turned into six and a
        rollback of a healthy run; with the update applied, the next step's norm was back to normal.
        """
        if self.spike_run_last != s.step - 1 or not s.finite or not math.isfinite(s.grad_norm):
            return None
        return self.grad_norm_spike.level

    # ---------------------------------------------------------------------------- for checkpoints and the end
    def loss_in_bounds(self, loss: float) -> bool:
        """Whether ``loss`` is finite and within the loss detector's current bounds (z-score and ratio), for a
        checkpoint's health verdict; True while the detector is warming up or disabled (if finite)."""
        if not self.cfg.loss_spike.enabled:
            return math.isfinite(loss)
        return self.loss_spike.in_bounds(loss)

    def loss_summary(self) -> LossSummary:
        """The loss detector's view of the lineage (its state travels with checkpoints): smoothed, best, clean
        initial loss and batch noise; all None (noise 0) while it has seen nothing or is disabled."""
        det = self.loss_spike
        if not self.cfg.loss_spike.enabled or det.ema.n == 0:
            return LossSummary(None, None, None, det.clean_initial, det.noise_std)
        return LossSummary(det.ema.mean, det.best, det.best_step, det.clean_initial, det.noise_std)

    @property
    def typical_grad_norm(self) -> float | None:
        """exp(EMA of log grad norm) over healthy steps: a streaming stand-in for the median healthy norm."""
        return self.grad_norm_spike.level

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state (plain dicts, lists, ints, finite floats, None)."""
        return {
            "version": STATE_VERSION,
            "detectors": {d.name: d.state() for d in self._all()},
            "skipped_steps": list(self.skipped_steps),
            "last_finding_step": self.last_finding_step,
            "spike_run_last": self.spike_run_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            if state.get("version") != STATE_VERSION:
                raise ValueError(f"version {state.get('version')!r}, expected {STATE_VERSION}")
            per = state["detectors"]
            for d in self._all():
                d.load(per[d.name])
            self.skipped_steps = deque(int(x) for x in state["skipped_steps"])
            lf = state["last_finding_step"]
            self.last_finding_step = None if lf is None else int(lf)
            run_last = state.get("spike_run_last")  # absent from states saved before it existed
            self.spike_run_last = None if run_last is None else int(run_last)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise ValueError(f"invalid detector state: {exc!r}") from None

    def _all(self) -> list[Detector]:
        return [self.nonfinite, self.grad_norm_spike, self.loss_spike, self.vanishing, self.stagnation,
                self.oscillation]
