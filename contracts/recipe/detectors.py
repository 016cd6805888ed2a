"""The ``detectors:`` section: what each anomaly detector watches, its thresholds and its action."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, StrictBool, StrictFloat, StrictInt

from contracts.recipe.base import Section


class Action(StrEnum):
    record = "record"
    skip_step = "skip_step"
    rollback = "rollback"


class NonFiniteDetector(Section):
    enabled: StrictBool = True
    """Check loss and gradients for NaN/Inf before optimizer.step()."""
    action: Action = Action.rollback
    """What to do on a non-finite loss or gradient (outside fp16 overflow handling)."""
    min_loss_scale: StrictFloat = Field(default=1.0, gt=0.0)
    """fp16: the loss scale has collapsed when it falls below this."""
    max_overflow_fraction: StrictFloat = Field(default=0.5, gt=0.0, le=1.0)
    """fp16: collapse also when more than this fraction of the last overflow_window steps overflowed."""
    overflow_window: StrictInt = Field(default=20, ge=1)
    """fp16: window (steps) for max_overflow_fraction."""


class GradNormSpikeDetector(Section):
    enabled: StrictBool = True
    """EMA z-score of log global grad norm (before clipping)."""
    action: Action = Action.skip_step
    """What to do on a spike."""
    z_threshold: StrictFloat = Field(default=6.0, gt=0.0)
    """Fire when (log norm - EMA mean) / EMA std exceeds this."""
    ema_alpha: StrictFloat = Field(default=0.05, gt=0.0, lt=1.0)
    """EMA coefficient."""
    warmup_steps: StrictInt = Field(default=25, ge=0)
    """Steps observed before the detector may fire."""
    patience: StrictInt = Field(default=1, ge=1)
    """Consecutive spiking steps needed to fire."""
    min_ratio: StrictFloat = Field(default=4.0, ge=1.0)
    """Also require the norm to exceed this multiple of the EMA level (guards against tiny variances)."""


class LossSpikeDetector(Section):
    enabled: StrictBool = True
    """Loss z-score against its EMA, loss far above the best smoothed loss or the initial loss, or a collapse back
    towards the initial loss."""
    action: Action = Action.rollback
    """What to do on divergence."""
    z_threshold: StrictFloat = Field(default=6.0, gt=0.0)
    """Fire when (loss - EMA mean) / EMA std exceeds this."""
    ratio_threshold: StrictFloat = Field(default=2.0, gt=1.0)
    """Fire when the smoothed loss exceeds this multiple of the best smoothed loss so far, and the best by 4
    batch-noise deviations (near a loss of 0 a multiple alone is batch noise: a fitted training set's rare misfit
    batch)."""
    max_initial_ratio: StrictFloat | None = Field(default=1.5, gt=1.0)
    """Fire (kind divergence) when the loss exceeds this multiple of the initial loss: the mean of the losses among
    the first 5 finite ones that were not skipped and not already this far above the mean so far. A healthy run
    never ends up far above where it started, so this rule needs no warmup (``warmup_steps`` does not apply to
    it): it catches the blow-up in the first steps of a too-high LR, which the warmup would hide. The rise must
    also be 4 batch-noise deviations, and 4 spreads of the untrained model's per-batch losses where they were
    measured (``untrained_steps``); still, for a loss with more than ~30% batch noise (MSE on a few samples) raise
    it or disable it. None disables."""
    collapse_fraction: StrictFloat | None = Field(default=0.8, gt=0.0, le=1.0)
    """Fire (kind divergence) when the smoothed loss has given back this fraction of the progress it made, from
    the initial loss down to the best smoothed loss (a run that learned, then collapsed back towards where it
    started). Only once the best smoothed loss is at least 10% (and 4 batch-noise deviations) below the initial
    loss; no warmup. None disables."""
    max_untrained_ratio: StrictFloat | None = Field(default=1.1, gt=1.0)
    """Fire (kind divergence, at once) when, in the first ``untrained_steps`` steps of a fresh start, the loss
    exceeds this multiple of the *untrained* model's loss on the same batch (and by 4 times the spread of the
    untrained losses across batches, for a loss whose per-batch value varies a lot). Before the first update the
    trainer measures the untrained model on the batches of those steps (forward only); the comparison is paired, so
    the batch's difficulty cancels, and a healthy run's loss on a batch is not far above the untrained model's:
    rising above it means the updates overshot (an LR above the stability edge, the blow-up a warmup prevents),
    however fast the loss falls back afterwards. None disables."""
    untrained_steps: StrictInt = Field(default=16, ge=0, le=1024)
    """How many of the first steps the untrained model is measured on (that many forward passes before the first
    update); 0 disables the ``max_untrained_ratio`` rule."""
    ema_alpha: StrictFloat = Field(default=0.05, gt=0.0, lt=1.0)
    """EMA coefficient for mean, variance and the smoothed loss."""
    warmup_steps: StrictInt = Field(default=25, ge=0)
    """Steps observed before the z-score and best-ratio rules may fire."""
    patience: StrictInt = Field(default=3, ge=1)
    """Consecutive anomalous steps needed to fire (any of the rules)."""


class VanishingDetector(Section):
    enabled: StrictBool = True
    """Global grad norm below a floor for N steps; per-layer norms decaying geometrically with depth."""
    action: Action = Action.record
    """What to do when gradients vanish."""
    min_grad_norm: StrictFloat = Field(default=1e-7, ge=0.0)
    """Floor on the global grad norm."""
    patience: StrictInt = Field(default=20, ge=1)
    """Consecutive steps below the floor needed to fire."""
    depth_slope_threshold: StrictFloat = Field(default=-0.5, lt=0.0)
    """Diagnose 'vanishing with depth' when the least-squares slope of ln(layer grad norm) per layer, measured
    from the output layer back toward the input (the way gradients flow), is below this: negative means the
    norms shrink toward the input; -0.5 is each layer about 0.6x the one above it."""
    warmup_steps: StrictInt = Field(default=10, ge=0)
    """Steps before the detector may fire."""


class StagnationDetector(Section):
    enabled: StrictBool = True
    """Update-to-weight ratio below a floor for N steps (training has stopped moving)."""
    action: Action = Action.record
    """What to do on stagnation."""
    min_update_ratio: StrictFloat = Field(default=1e-7, ge=0.0)
    """Floor on ||lr * update|| / ||weights||."""
    patience: StrictInt = Field(default=5, ge=1)
    """Consecutive measurements below the floor needed to fire."""
    warmup_steps: StrictInt = Field(default=20, ge=0)
    """Steps before the detector may fire."""


class OscillationDetector(Section):
    enabled: StrictBool = True
    """Loss variance over a window far above its running level."""
    action: Action = Action.record
    """What to do on oscillation."""
    window: StrictInt = Field(default=20, ge=3)
    """Window (steps) of the short-term loss variance."""
    variance_ratio: StrictFloat = Field(default=25.0, gt=1.0)
    """Fire when window variance exceeds this multiple of the long-run variance."""
    ema_alpha: StrictFloat = Field(default=0.01, gt=0.0, lt=1.0)
    """EMA coefficient of the long-run variance."""
    warmup_steps: StrictInt = Field(default=50, ge=0)
    """Steps before the detector may fire."""
    patience: StrictInt = Field(default=5, ge=1)
    """Consecutive anomalous steps needed to fire."""


class Detectors(Section):
    nonfinite: NonFiniteDetector = Field(default_factory=NonFiniteDetector)
    """Non-finite loss or gradients; fp16 loss-scale collapse."""
    grad_norm_spike: GradNormSpikeDetector = Field(default_factory=GradNormSpikeDetector)
    """Gradient-norm spikes."""
    loss_spike: LossSpikeDetector = Field(default_factory=LossSpikeDetector)
    """Loss spikes and divergence."""
    vanishing: VanishingDetector = Field(default_factory=VanishingDetector)
    """Vanishing gradients."""
    stagnation: StagnationDetector = Field(default_factory=StagnationDetector)
    """Stagnation."""
    oscillation: OscillationDetector = Field(default_factory=OscillationDetector)
    """Oscillation / noise."""
    max_skipped_steps: StrictInt = Field(default=5, ge=1)
    """skip_step escalates to rollback when more than this many steps were skipped (or, as the second and later of
    consecutive spikes, applied with the gradient clipped to the healthy norm) ..."""
    skip_window: StrictInt = Field(default=50, ge=1)
    """... within this many steps."""
