"""The loss rules: spikes, divergence from the best, blow-ups above the initial loss, and collapse."""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from contracts.recipe import (
    LossSpikeDetector,
)
from workers.detectors.base import (
    INITIAL_LOSS_STEPS,
    LOSS_STD_FLOOR,
    MIN_PROGRESS,
    NOISE_MARGIN,
    Detector,
    Ema,
    Emit,
    StepSignals,
    Streak,
)


@dataclass(frozen=True)
class LossSummary:
    """What the loss detector knows about the lineage, for checkpoint health and the outcome verdict."""

    smoothed: float | None
    """The EMA of the loss now."""
    best: float | None
    """The best (lowest) smoothed loss so far, and its step."""
    best_step: int | None
    initial: float | None
    """The clean initial loss (``LossSpike.clean_initial``)."""
    noise_std: float
    """Batch-to-batch standard deviation of the loss."""


class LossSpike(Detector):
    """Four rules on the loss, sharing one patience run, and a fifth that needs none.

    The **untrained ratio** (kind ``divergence``, rule ``worse_than_untrained``) fires at once: in the first
    ``untrained_steps`` steps of a fresh start the loss is above ``max_untrained_ratio`` times the untrained
    model's loss on the same batch (``set_untrained``: the trainer measures it before the first update), and by at
    least ``NOISE_MARGIN`` times the spread of those untrained losses across batches. The comparison is paired, so
    the batch's own difficulty cancels and no patience is needed; what does not cancel is how a healthy early
    update, good on average, moves the loss of one particular batch, which can be large where the per-batch loss
    varies a lot (a regression on a few samples, a deep residual MLP at initialisation): the spread of the
    untrained losses is that scale, measured before any update, so no blow-up can inflate it. The statistics the
    other rules judge against were never exposed to the blow-up, because it is caught where it happens.

    The other four share one patience run; the finding names the first that holds, in this order:

    - **ratio to best** (kind ``divergence``): the smoothed loss (the EMA mean) above ``ratio_threshold`` times
      the best smoothed loss so far (kept once the smoothed loss averages ``INITIAL_LOSS_STEPS`` losses, so that
      one easy first batch does not set it), and by at least ``NOISE_MARGIN`` batch-noise deviations: near a loss
      of 0 a ratio says nothing (a classifier that fits its training set scores 0 on most batches and 0.1 on a
      rare one, and each of those lifts a smoothed loss of 1e-3 to several times its best);
    - **z-score** (kind ``loss_spike``): the loss's z-score against its EMA above ``z_threshold``;
    - **initial ratio** (kind ``divergence``): the loss above ``max_initial_ratio`` times the initial loss;
    - **collapse** (kind ``divergence``): the smoothed loss has given back ``collapse_fraction`` of the progress
      from the initial loss down to the best smoothed loss.

    The first two wait for ``warmup_steps``, which would hide a blow-up in the first steps of a too-high LR (the
    most dangerous moment without an LR warmup); the last two need no warmup, because a healthy run never ends far
    above, or back at, where it started. The EMA absorbs every loss that is neither a z-outlier nor above the
    initial ratio, so a slow drift raises the smoothed loss until the ratio test fires, while a sudden jump is held
    out of the baseline and fires after ``patience`` steps.

    The initial loss is the mean of the losses absorbed among the first ``INITIAL_LOSS_STEPS`` finite ones, so that
    one easy batch does not set the bar, while a loss already above the initial ratio is left out (a blow-up at
    step 1 would otherwise raise its own bar). Neither initial rule fires while it is unknown or not positive (a
    ratio to a loss <= 0 means nothing). Both also demand ``NOISE_MARGIN`` batch-noise deviations: the rise above
    the initial loss, and the progress below it before a collapse counts (besides ``MIN_PROGRESS``), so that a
    noisy per-batch loss is not taken for divergence. Where the untrained model was measured, the rise above the
    initial loss must also be ``NOISE_MARGIN`` spreads of those untrained losses: the first batch may be one of
    the easy ones, and a run at a small LR (a long warmup) scores about the untrained model's loss on the next
    batches, which can lie 2x above it where the per-batch loss varies widely (a deep MLP on a regression); that
    spread is measured before any update, so no blow-up can widen it. The batch noise is estimated from
    step-to-step changes (an EMA of (Δloss)²/2: blind to the level, a trend adds only its per-step slope) of the
    losses that are not z-outliers, each capped at the initial-ratio limit, leaving out the rises into the cap: a
    blow-up is such a rise and a plateau above the cap is flat, so neither widens the margin that is meant to catch
    it, while the falls from the cap keep the noise of a loss that only seemed too high in view. Measured on
    synthetic healthy runs of 600 steps, 500 seeds each (chi-squared batch noise; the untrained losses the same
    batches at the starting level): with 12% relative batch noise 1 run fires, with 19% 1, with 25% 1, with 35%
    (MSE on 16 samples) 13 (2.6%); without the untrained measurement 1, 6, 17 and 44, nearly all within 10 steps
    after an unluckily low first batch. For a noisier loss raise ``max_initial_ratio`` or set it to None.

    Onset: the first step of the anomalous run; for the ratio to best it is moved back to just after the last step
    at which the smoothed loss was still calm (within ``sqrt(ratio_threshold)`` of the best), because the
    smoothed loss crosses the ratio well after the rise began (a run that diverged during the detector's warmup
    gets an onset inside the warmup); for the collapse, likewise, to just after the last step at which it had given
    back at most half of ``collapse_fraction``."""

    name = "loss_spike"
    cfg: LossSpikeDetector

    def __init__(self, cfg: LossSpikeDetector) -> None:
        super().__init__(cfg)
        self.ema = Ema(cfg.ema_alpha)
        self.run = Streak()
        self.best: float | None = None
        self.best_step: int | None = None
        self.calm_step: int | None = None
        self.collapse_calm_step: int | None = None
        """Last step at which the smoothed loss had given back at most half of ``collapse_fraction``."""
        self.initial: float | None = None
        """Mean of the ``initial_n`` losses absorbed among the first ``initial_seen`` finite ones."""
        self.initial_n = 0
        self.initial_seen = 0
        self.first_loss: float | None = None
        """The lineage's first finite loss, measured before any update: no blow-up can have raised it."""
        self.noise = Ema(cfg.ema_alpha)
        """EMA of (Δloss)²/2 between consecutive noise samples, except rises into the cap: the batch-noise variance."""
        self.last_loss: float | None = None
        """The last noise sample: a loss that was not a z-outlier, capped at the initial-ratio limit."""
        self._pending: tuple[int, float] | None = None
        self._pending_noise: tuple[float, bool] | None = None  # (noise sample, capped)
        self._seen = False
        self._first: float | None = None
        self.untrained: list[float] = []
        """The untrained model's loss on the batches of steps 0, 1, ... of a fresh start (empty: not measured)."""
        self.untrained_run = Streak()
        self._untrained_spread = 0.0
        """Standard deviation of the finite untrained losses, a batch far out of scale left out (``_spread``): the
        batch-to-batch scale of the paired rule."""

    def set_untrained(self, losses: list[float]) -> None:
        """The untrained model's loss per step of a fresh start (the trainer measures it before the first update);
        only as many as ``untrained_steps`` are kept."""
        self.untrained = [float(x) for x in losses[: self.cfg.untrained_steps]]
        self._untrained_spread = _spread(self.untrained)

    def _untrained_limit(self, step: int) -> float | None:
        """The loss above which the untrained-ratio rule holds at ``step``; None where it cannot fire."""
        ratio = self.cfg.max_untrained_ratio
        if ratio is None or not 0 <= step < len(self.untrained):
            return None
        base = self.untrained[step]
        if not (math.isfinite(base) and base > 0.0):
            return None
        return base + max((ratio - 1.0) * base, NOISE_MARGIN * self._untrained_spread)

    def _std(self) -> float:
        return max(self.ema.std, LOSS_STD_FLOOR * abs(self.ema.mean), 1e-12)

    def _noise_margin(self) -> float:
        """``NOISE_MARGIN`` batch-noise standard deviations (0 until there are two noise samples)."""
        return NOISE_MARGIN * math.sqrt(self.noise.mean) if self.noise.n else 0.0

    @property
    def clean_initial(self) -> float | None:
        """The initial loss no early blow-up can poison: the lower of the first loss and the initial mean."""
        known = [x for x in (self.first_loss, self.initial) if x is not None]
        return min(known) if known else None

    @property
    def noise_std(self) -> float:
        """Batch-to-batch standard deviation of the loss (0 until there are two samples)."""
        return math.sqrt(self.noise.mean) if self.noise.n else 0.0

    def _initial_limit(self) -> float | None:
        """The loss above which the initial-ratio rule holds; None while it cannot fire."""
        ratio, initial = self.cfg.max_initial_ratio, self.clean_initial
        if ratio is None or initial is None or initial <= 0.0:
            return None
        return initial + max((ratio - 1.0) * initial, self._noise_margin(), NOISE_MARGIN * self._untrained_spread)

    def _ratio_limit(self) -> float | None:
        """The smoothed loss above which the ratio-to-best rule holds; None while there is no positive best."""
        best = self.best
        if best is None or best <= 0.0:
            return None
        return max(self.cfg.ratio_threshold * best, best + self._noise_margin())

    def _collapse_limit(self, share: float = 1.0) -> float | None:
        """The smoothed loss above which the collapse rule holds (with ``share`` = 0.5: the level up to which the
        smoothed loss still counts as calm, for the onset); None while the rule cannot fire."""
        frac, initial, best = self.cfg.collapse_fraction, self.clean_initial, self.best
        if frac is None or initial is None or best is None or self.initial_seen < INITIAL_LOSS_STEPS:
            return None  # the initial loss is still moving with the running mean: nothing to collapse back to yet
        if initial <= 0.0 or initial - best < max(MIN_PROGRESS * initial, self._noise_margin()):
            return None
        return best + share * frac * (initial - best)

    def evaluate(self, s: StepSignals, emit: Emit) -> None:
        cfg, loss = self.cfg, s.loss
        self._pending = self._pending_noise = None
        self._seen = math.isfinite(loss)
        if not self._seen:
            return
        self._first = loss
        z_anom = ratio_anom = False
        z = std = 0.0
        best = self.best
        if self.ema.n >= max(cfg.warmup_steps, 2):
            std = self._std()
            z = (loss - self.ema.mean) / std
            z_anom = z > cfg.z_threshold
            ratio_limit = self._ratio_limit()
            ratio_anom = ratio_limit is not None and self.ema.mean > ratio_limit
        init_limit, collapse_limit = self._initial_limit(), self._collapse_limit()
        init_anom = init_limit is not None and loss > init_limit
        collapse_anom = collapse_limit is not None and self.ema.mean > collapse_limit
        untrained_limit = self._untrained_limit(s.step)
        untrained_anom = untrained_limit is not None and loss > untrained_limit
        self.untrained_run.update(untrained_anom, s.step)
        if untrained_anom and untrained_limit is not None and self.untrained_run.fires(1, cfg.action):
            emit(self, "divergence", loss, untrained_limit, cfg.action, self.untrained_run.onset,
                 {"rule": "worse_than_untrained", "untrained_loss": self.untrained[s.step],
                  "ratio": loss / self.untrained[s.step], "initial_loss": self.clean_initial})
        anomalous = z_anom or ratio_anom or init_anom or collapse_anom
        self.run.update(anomalous, s.step)
        if anomalous and self.run.fires(cfg.patience, cfg.action):
            details = {"z": z, "ema_mean": self.ema.mean, "ema_std": self.ema.std, "best_smoothed": self.best,
                       "best_step": self.best_step, "initial_loss": self.clean_initial, "run_length": self.run.count}
            if ratio_anom and best is not None:
                onset = self.run.onset
                if self.calm_step is not None and onset is not None:
                    onset = min(onset, self.calm_step + 1)
                emit(self, "divergence", self.ema.mean, self._ratio_limit(), cfg.action, onset,
                     {**details, "rule": "ratio_to_best", "loss": loss, "calm_step": self.calm_step})
            elif z_anom:
                emit(self, "loss_spike", loss, self.ema.mean + cfg.z_threshold * std, cfg.action,
                     self.run.onset, {**details, "rule": "z_score"})
            elif init_anom:
                emit(self, "divergence", loss, init_limit, cfg.action, self.run.onset,
                     {**details, "rule": "initial_ratio", "initial_losses": self.initial_n,
                      "initial_steps": self.initial_seen})
            else:
                onset = self.run.onset
                if self.collapse_calm_step is not None and onset is not None:
                    onset = min(onset, self.collapse_calm_step + 1)
                emit(self, "divergence", self.ema.mean, collapse_limit, cfg.action, onset,
                     {**details, "rule": "collapse", "loss": loss, "calm_step": self.collapse_calm_step})
        if not (z_anom or init_anom or untrained_anom):
            self._pending = (s.step, loss)
        if not (z_anom or untrained_anom):
            self._pending_noise = (init_limit, True) if init_anom and init_limit is not None else (loss, False)

    def commit(self, absorb: bool) -> None:
        window = self._seen and self.initial_seen < INITIAL_LOSS_STEPS
        if window and self.initial_seen == 0 and self._first is not None:
            self.first_loss = self._first
        self._first = None
        if window:
            self.initial_seen += 1
        self._seen = False
        if absorb and self._pending is not None:
            step, loss = self._pending
            self.ema.update(loss)
            if window:
                self.initial_n += 1
                self.initial = loss if self.initial is None else self.initial + (loss - self.initial) / self.initial_n
            # the best smoothed loss only once the smoothed loss averages a few batches: at first it is a running
            # mean of one, two, ... losses, and an easy first batch would set a best that the typical loss is 2x of
            # (a linear regression under SGD was stopped at step 27 as a divergence: best 0.44, at step 0)
            if self.ema.n >= INITIAL_LOSS_STEPS and (self.best is None or self.ema.mean < self.best):
                self.best, self.best_step = self.ema.mean, step
            if self.best is None or self.ema.mean <= math.sqrt(self.cfg.ratio_threshold) * self.best:
                self.calm_step = step
            calm = self._collapse_limit(0.5)
            if calm is not None and self.ema.mean <= calm:
                self.collapse_calm_step = step
        if absorb and self._pending_noise is not None:
            x, capped = self._pending_noise
            if self.last_loss is not None and (x < self.last_loss or not capped):
                self.noise.update((x - self.last_loss) ** 2 / 2.0)
            self.last_loss = x
        self._pending = self._pending_noise = None

    def in_bounds(self, loss: float) -> bool:
        if not math.isfinite(loss):
            return False
        init_limit, collapse_limit = self._initial_limit(), self._collapse_limit()
        if init_limit is not None and loss > init_limit:
            return False
        if collapse_limit is not None and self.ema.mean > collapse_limit:
            return False
        if self.ema.n < max(self.cfg.warmup_steps, 2):
            return True
        if loss > self.ema.mean + self.cfg.z_threshold * self._std():
            return False
        ratio_limit = self._ratio_limit()
        return ratio_limit is None or self.ema.mean <= ratio_limit

    def state(self) -> dict[str, Any]:
        return {"ema": self.ema.state(), "run": self.run.state(), "best": self.best, "best_step": self.best_step,
                "calm_step": self.calm_step, "initial": self.initial, "initial_n": self.initial_n,
                "initial_seen": self.initial_seen, "noise": self.noise.state(), "last_loss": self.last_loss,
                "first_loss": self.first_loss,
                "collapse_calm_step": self.collapse_calm_step,
                "untrained": [x if math.isfinite(x) else None for x in self.untrained],
                "untrained_run": self.untrained_run.state()}

    def load(self, d: dict[str, Any]) -> None:
        self.ema.load(d["ema"])
        self.run.load(d["run"])
        self.best = None if d["best"] is None else float(d["best"])
        self.best_step = None if d["best_step"] is None else int(d["best_step"])
        self.calm_step = None if d["calm_step"] is None else int(d["calm_step"])
        if "initial_seen" in d:
            self.noise.load(d["noise"])
            self.last_loss = None if d["last_loss"] is None else float(d["last_loss"])
            self.collapse_calm_step = None if d["collapse_calm_step"] is None else int(d["collapse_calm_step"])
            self.initial = None if d["initial"] is None else float(d["initial"])
            self.initial_n, self.initial_seen = int(d["initial_n"]), int(d["initial_seen"])
            self.untrained = [math.nan if x is None else float(x) for x in d.get("untrained") or []]
            self._untrained_spread = _spread(self.untrained)
            if "untrained_run" in d:
                self.untrained_run.load(d["untrained_run"])
            first = d.get("first_loss")
            self.first_loss = None if first is None else float(first)
            if not (0 <= self.initial_n <= self.initial_seen <= INITIAL_LOSS_STEPS
                    and (self.initial is None) == (self.initial_n == 0)
                    and (self.initial is None or math.isfinite(self.initial))):
                raise ValueError(f"bad initial loss {d['initial']!r} ({d['initial_n']!r} of {d['initial_seen']!r})")
        else:
            # state saved before the initial-loss rules existed: that run's initial loss is unknown and the losses
            # after the resume are not it, so both rules stay off for the rest of the run
            self.initial, self.initial_n, self.initial_seen = None, 0, INITIAL_LOSS_STEPS


OUTLIER_MADS = 10.0
"""How many median absolute deviations from the median an untrained loss may lie and still count towards the
spread. Batch noise, even heavy-tailed, stays well inside (a normal sample of 16 reaches ~4 MADs); a poisoned batch
(inputs 1e5x out of scale) lies ~1e9 MADs out, and counted it would make the spread, and with it every margin that
uses it, as large as itself: its own loss and its update then pass as noise, and the loss the EMA absorbs from it
later fires the ratio-to-best rule on a healthy run."""


def _spread(values: list[float]) -> float:
    """Sample standard deviation of the finite values that lie within ``OUTLIER_MADS`` median absolute deviations of
    their median (0 with fewer than two)."""
    finite = [x for x in values if math.isfinite(x)]
    if len(finite) >= 3:
        med = statistics.median(finite)
        mad = statistics.median(abs(x - med) for x in finite)
        if mad > 0.0:
            finite = [x for x in finite if abs(x - med) <= OUTLIER_MADS * mad]
    if len(finite) < 2:
        return 0.0
    mean = sum(finite) / len(finite)
    return math.sqrt(sum((x - mean) ** 2 for x in finite) / (len(finite) - 1))
