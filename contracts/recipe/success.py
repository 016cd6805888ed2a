"""The ``success:`` section: what a run must show at its end to be SUCCEEDED, not only that it reached max_steps."""

from __future__ import annotations

from pydantic import Field, StrictFloat, StrictInt

from contracts.recipe.base import Section


class Success(Section):
    window: StrictInt = Field(default=20, ge=1, le=10_000)
    """The final loss is the mean of the last this-many finite per-step losses of the attempt."""
    regression_tolerance: StrictFloat = Field(default=0.1, ge=0.0, le=10.0)
    """No regression: the final loss may be at most this fraction above the best smoothed loss the lineage
    reached (a run that learned, then drifted back up, is degraded and is rolled back to its best checkpoint)."""
    min_progress: StrictFloat = Field(default=0.25, ge=0.0, le=1.0)
    """Real progress: the final loss must have covered this fraction of the way from the clean initial loss down
    to the data's known loss floor, and at the end be below what the best prediction that ignores the inputs
    scores (the data's trivial loss: built-in data knows it; for a user's dataset it is measured on the training
    targets). Where no floor is known the way ends at that trivial loss (at 0 when it is unknown too: a custom
    loss). 0 turns both rules off."""
    early_check_fraction: StrictFloat = Field(default=0.25, gt=0.0, le=1.0)
    """At this fraction of training.max_steps (and not before 3x the warmup), a run that has covered less than
    early_min_progress of that way has never learned: it is stopped then instead of at the end."""
    early_min_progress: StrictFloat = Field(default=0.05, ge=0.0, le=1.0)
    """Fraction of the way to the floor the smoothed loss must have covered by the early check (0: no check)."""
    stall_fraction: StrictFloat | None = Field(default=0.2, gt=0.0, le=1.0)
    """Stalled far from the floor (only where the data's loss floor is known): the best smoothed loss has not
    improved for this fraction of training.max_steps (and at least two of the loss detector's EMA horizons) while it
    has covered less than stall_max_progress of the way from the initial loss to the floor. The LR is too high for
    where the model is (the loss stopped falling and sat, or rose, at a level a healthy run passes through), so the
    attempt ends there and, like a run that never learned, starts again with a lower LR. None turns the rule off."""
    stall_max_progress: StrictFloat = Field(default=0.75, gt=0.0, le=1.0)
    """The share of the way to the floor below which a run may not level off (see stall_fraction)."""
    stall_min_gain: StrictFloat = Field(default=0.01, ge=0.0, lt=1.0)
    """For the stall rule, the best smoothed loss has improved only when it fell by at least this share of the way
    from the initial loss to the floor since the last improvement that counted. On a flat, noisy plateau the
    smoothed loss touches a marginally lower best now and then by chance; each such touch restarted the stall clock.
    0: any new best counts."""
    collapse_ratio: StrictFloat | None = Field(default=0.4, gt=0.0, lt=1.0)
    """Knocked flat (a fresh start, only where the data's loss floor is known, in the first half of the run): the
    median pre-clip gradient norm of the last loss-EMA horizon (1/ema_alpha steps) has fallen below this fraction
    of the median of the first five steps while the median loss of those steps has covered less than
    collapse_max_progress of the way from the initial loss to the floor. A healthy run's gradients shrink as its
    loss approaches a minimum; ones that shrink while the loss is still near where it started mean a too-high LR
    pushed the model into a flat region (saturated softmax, LayerNorm or units), where it descends slowly and ends
    under-trained without any spike. The attempt ends there and, like a stalled one, starts again with a lower LR.
    None turns the rule off."""
    collapse_max_progress: StrictFloat = Field(default=0.3, gt=0.0, le=1.0)
    """The share of the way to the floor below which a gradient collapse counts (see collapse_ratio)."""
    eval_regression_tolerance: StrictFloat | None = Field(default=0.1, ge=0.0, le=10.0)
    """With training.eval_interval: the final held-out (eval) loss may be at most this fraction above the best eval
    loss of the lineage, and must be below the first one (measured before any update); None: the eval loss is
    recorded but never judged. The eval batches are the same every time, so there is no batch noise to allow for."""
    loss_floor: StrictFloat | None = Field(default=None, ge=0.0)
    """The lowest loss your data allows, in the loss's units, when you know it (e.g. an estimate of its entropy for
    a language model's cross-entropy): the floor the progress rules measure the way toward. Built-in data knows its
    own (this replaces it); user data has none, and then progress is measured toward what ignoring the inputs
    scores (toward 0 where that is unknown too) and the rules that need a floor (stall, collapse) are off."""
    max_final_loss: StrictFloat | None = Field(default=None)
    """Your own bar: the final loss must be at most this (None: no bar)."""
