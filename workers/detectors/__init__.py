"""Streaming anomaly detectors: one step's signals in, one decision (record / skip_step / rollback) out.

The loop all-reduces the signals across ranks before calling ``DetectorSuite.observe``, so every rank computes
the same decision at the same step (a rank that skipped while another stepped would deadlock the next
collective). Everything here is pure Python on floats: no torch, O(1) work and state per step (the few ring
buffers are bounded by the recipe's window sizes), and the whole state is a JSON-able dict saved in checkpoints.

Rules shared by all detectors:

- **Patience**: a detector's condition must hold on ``patience`` consecutive observations. The finding is emitted
  on the step the run reaches ``patience``; while the run goes on, further findings are emitted only when the
  action is ``skip_step`` (each of those updates is discarded and counted). A ``record`` detector therefore
  reports an episode once, and ``rollback`` ends the attempt at the first finding anyway.
- **No poisoning**: a value that meets its own detector's condition is never absorbed into that detector's
  running statistics, and nothing at all is absorbed on a step whose decision is ``skip_step`` or ``rollback``
  (that step did not happen as far as the statistics are concerned). Non-finite values are never absorbed.
- **Non-finite always skips**: a non-finite loss or gradient gets at least ``skip_step`` even if the recipe says
  ``record`` or the nonfinite detector is disabled, because weights must never be updated with non-finite
  gradients. ``record`` there means "skip it and keep going" (the finding's ``details.configured_action`` says
  what the recipe asked for); those skips count towards escalation like any other.
- **Escalation**: more than ``max_skipped_steps`` skip_step decisions within ``skip_window`` steps add a rollback
  finding of kind ``skip_escalation`` (onset: the first skipped step in the window).
- **A skip that recurs is the weights' fault**: a skipped update leaves the weights unchanged, so a finite step
  that must be skipped right after a finite skip spiked on another batch at the same weights. The first step of
  such a run is skipped; the second and later ones are applied with their gradient clipped to the healthy level
  (``Decision.clip_to``; the findings' ``details.applied_clipped_to``). They count towards escalation all the
  same: a spike that persists is still rolled back, one that the next update leaves behind is not.
- **fp16**: a GradScaler overflow (``overflow=True`` with a finite loss) is normal and not a finding; the scaler
  already dropped that update. The signal is a collapsing scale or overflows on most recent steps. A non-finite
  *loss* under fp16 is still a nonfinite finding: loss scaling cannot fix a forward pass that overflowed.
"""

from workers.detectors.base import (
    INITIAL_LOSS_STEPS,
    LOSS_STD_FLOOR,
    MIN_DEPTH_POINTS,
    MIN_PROGRESS,
    NOISE_MARGIN,
    OSCILLATION_FLOOR,
    STATE_VERSION,
    Decision,
    Finding,
    StepSignals,
    depth_slope,
    diagnose_depth,
    stronger,
)
from workers.detectors.loss import LossSummary
from workers.detectors.suite import DetectorSuite

__all__ = [
    "INITIAL_LOSS_STEPS", "LOSS_STD_FLOOR", "MIN_DEPTH_POINTS", "MIN_PROGRESS", "NOISE_MARGIN", "OSCILLATION_FLOOR",
    "STATE_VERSION", "Decision", "DetectorSuite", "Finding", "LossSummary", "StepSignals", "depth_slope",
    "diagnose_depth", "stronger",
]
