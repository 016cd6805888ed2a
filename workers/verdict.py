"""The outcome verdict: is the model healthy where the attempt ends? Pure: numbers in, a verdict out.

Reaching ``max_steps`` is not success. An attempt that ran to its end is judged on what Ballast can see at run
time (the recipe's ``success`` section holds the tolerances):

- **vanishing**: the gradients vanished (the vanishing detector fired) and the model made no real progress. No
  tightening of the LR or the clip threshold can help, so the recovery policy gives up with this diagnosis.
- **never learned**: the final loss has not covered ``min_progress`` of the way from the clean initial loss down
  to the data's known loss floor; where no floor is known (a user's data), down to the trivial loss (below), and
  to 0 when that is unknown too (``_way``). The same test, with ``early_min_progress``, runs once at the
  early check (``early_check_step``), so a run that never learns is stopped after a quarter of its steps; there
  too, a run whose gradients vanished gets the vanishing diagnosis, not a retry that cannot help.
- **stalled** (checked at every step, only where the data's loss floor is known): the best smoothed loss has not
  improved for ``stall_steps`` while it is still short of ``stall_max_progress`` of the way from the clean
  initial loss to the floor. Improved means by at least ``stall_min_gain`` of that way (``progress_mark``): on a
  flat plateau the batch noise lets the smoothed loss touch a marginally lower best now and then, and a clock that
  any new best restarts may never run out. A healthy run levels off near its floor, not a quarter or half of the
  way there: a run that stops improving far above it (a too-high LR that the model can no longer descend at,
  typically reached at the end of the warmup) is under-trained however long it goes on, and waiting for the end only
  spends steps. Like a run that never learned, the onset is the attempt's start: every step so far ran at the
  LR that stalled it, and its checkpoints, best one included, hold weights that a lower LR does not bring back
  (measured on development runs: from the best checkpoint the retries ended at 1.2-1.9x the loss a safe LR
  reaches, from initialisation within 2% of it). A resumed attempt gets a window of its own while it runs, but at
  the end the lineage is judged whole (``StallClock``, checkpointed): one that once stood still for a window and
  is still short of the bar is stalled, however the steps after a resume crept lower.
- **collapsed** (checked at every step of a fresh start's first half, only where the data's loss floor is known):
  the median pre-clip gradient norm of the last ``collapse_window`` steps is below ``collapse_ratio`` of the
  median of the first five while the median loss of those steps has covered less than ``collapse_max_progress``
  of the way to the floor. A healthy run's gradient norm falls as its loss nears a minimum; one that falls while
  the loss is still near its start says an early, too-large step put the model in a flat region (a saturated
  softmax, LayerNorm or units), from which it descends slowly and ends under-trained with no spike for any loss
  rule to see. Medians, so that one poisoned batch moves neither number. The onset is the attempt's start, as
  for a stall. (On the first five fresh sets and the benchmark's development half, healthy runs kept at least
  0.62 of their initial gradient norm while their loss was within its first quarter of the way; the three high-LR
  transformer runs that ended 1.2-1.6x their references fell to 0.33-0.40 there. BENCHMARKS.md, 2026-12-06. The
  references of the first nine fresh sets and the development half kept 0.62 within the first 30% too, and the
  bar moved there: the development half's warmup plateau fell to 0.27x at 24-26% of the way, one side of a 25% bar
  or the other by machine. BENCHMARKS.md, 2026-12-07.)
- **degraded**: the final loss is more than ``regression_tolerance`` above the best smoothed loss the lineage
  reached; the onset is just after the best step, so the rollback goes back to the best checkpoint.
- **eval degraded / never learned (held out)**, only when the attempt measured an eval loss
  (``training.eval_interval``) and ``eval_regression_tolerance`` is set: the training loss can look fine while the
  held-out loss says otherwise. The final eval loss must be finite and at most ``eval_regression_tolerance`` above
  the lineage's best eval loss (**eval_degraded**; the onset is the step after the best eval, so the rollback goes
  back to a checkpoint at or before it); and it must be below the lineage's first eval loss, measured before any
  update (**never_learned**: nothing that generalises was learned). The eval batches are the same every time, so
  unlike the per-step loss there is no batch noise to allow for. The held-out loss is only asked to improve at all,
  not to cover ``min_progress``: the generalisation gap is the data's and the model's, not a stability matter.
  Either is **overfitting** when the (finite) held-out loss rose while the training loss fell by more than
  ``eval_regression_tolerance`` of itself since the eval loss was at its best (``EvalEvidence.train_at_best``):
  the model fits its training data at the held-out data's expense, which a lower LR or clip threshold does not
  fix (the recovery policy gives up with the diagnosis rather than retrying; measured: a 4-layer MLP memorising
  192 samples was restarted from initialisation at a quarter of the LR and failed again, 2.1x the steps).
- **above the bar**: the final loss is above the user's ``max_final_loss``.

Real progress is also judged against what learning nothing scores: a final loss no lower than the data's
``trivial_loss`` (the best prediction that ignores the inputs: the targets' mean, or their frequencies; built-in data
knows it, and on a user's dataset the trainer measures it on the training targets, where a floor is unknown and
progress toward 0 would let a model that learned only the mean or the frequencies pass) is **never_learned** however
far it fell from the initial loss, since an initialisation that blows the loss up (a deep net at a large init scale
starts near 1e6 on unit-variance targets) makes any fall look like progress. "No lower" allows for the noise
(``TRIVIAL_MARGIN_SE`` standard errors of the final loss, measured on the ``window`` losses it is the mean of; not the
loss detector's batch noise, which a blown-up start inflates): a model at the trivial loss ends below it half the time
by chance, and where the trivial loss is itself measured on a sample of the targets (a large dataset), the estimate
can sit above the true figure. Only at the end (early on, a healthy run may still be above it), and off with the other
progress rules (``min_progress: 0``).

The clean initial loss is the lower of the first finite loss of the lineage (measured before any update, so no
blow-up can raise it) and the detector's mean of the first few losses: a blow-up in the first steps must not
make a plateau at the initial level look like progress.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contracts.recipe import Success

VANISHING = "vanishing"
NEVER_LEARNED = "never_learned"
STALLED = "stalled"
COLLAPSED = "collapsed"
DEGRADED = "degraded"
ABOVE_BAR = "above_bar"
EVAL_DEGRADED = "eval_degraded"
OVERFITTING = "overfitting"
VERDICT_KINDS = (VANISHING, NEVER_LEARNED, STALLED, COLLAPSED, DEGRADED, EVAL_DEGRADED, OVERFITTING, ABOVE_BAR)
TRIVIAL_MARGIN_SE = 2.0
"""A final loss this many of its standard errors (``Evidence.final_sem``) below the trivial loss is still no
better than it (see the module docstring)."""
COLLAPSE_BASELINE_STEPS = 5
"""The gradient-collapse rule's baseline: the median pre-clip gradient norm of a fresh start's first steps."""


@dataclass(frozen=True)
class Verdict:
    """What was found wrong (``kind`` None: healthy), on which numbers, and where it went wrong."""

    kind: str | None
    reason: str
    value: float | None = None
    threshold: float | None = None
    onset_step: int | None = None

    @property
    def healthy(self) -> bool:
        return self.kind is None


@dataclass(frozen=True)
class EvalEvidence:
    """What the lineage's held-out (eval) losses showed; steps are completed steps (a checkpoint's numbering)."""

    initial: float | None
    """The eval loss before any update (step 0 of the lineage); None when unknown."""
    best: float | None
    """The lowest finite eval loss of the lineage, and its step."""
    best_step: int | None
    final: float
    """The newest eval loss (NaN when it was not finite)."""
    final_step: int
    train_at_best: float | None = None
    """The training loss where the eval loss was best: the mean of the last ``success.window`` finite losses up to
    that step, the clean initial loss when that was before any update, None when it was in an earlier attempt."""


@dataclass(frozen=True)
class Evidence:
    """The numbers the verdict reads, gathered by the trainer."""

    final_loss: float | None
    """Mean of the last ``success.window`` finite losses of the attempt (None: none finite)."""
    best_loss: float | None
    """Best smoothed loss of the lineage (the loss detector's, restored with the checkpoint on resume)."""
    best_step: int | None
    initial_loss: float | None
    """Clean initial loss of the lineage (see the module docstring)."""
    loss_floor: float | None
    """The data's best achievable loss, when known."""
    trivial_loss: float | None = None
    """The loss of the best prediction that ignores the inputs (``DataSource.trivial_loss``), when known."""
    noise_std: float = 0.0
    """Batch-to-batch standard deviation of the loss (the loss detector's estimate): the regression test allows
    one of it on top of the tolerance, since the best smoothed loss of a noisy loss is biased low."""
    final_sem: float = 0.0
    """The standard error of ``final_loss``: those losses' standard deviation ÷ √their number (0: fewer than two)."""
    vanishing: bool = False
    """The vanishing detector fired in this attempt."""
    start_step: int = 0
    progress_step: int | None = None
    """Where the stall clock starts: the step of the last best smoothed loss that improved by ``stall_min_gain``
    (``progress_mark``); None: ``best_step``."""
    stalled_for: int = 0
    """The most steps the lineage went without such an improvement while short of ``stall_max_progress``
    (``StallClock.longest``), and the step that stretch began at (``stalled_from``)."""
    stalled_from: int = 0
    eval: EvalEvidence | None = None
    """The eval series, when the attempt measured one (None: the verdict reads the training loss only)."""


def final_loss(
    losses: Sequence[float], window: int, *, start_step: int = 0, skipped: Collection[int] = ()
) -> float | None:
    """Mean of the last ``window`` finite losses (None when there is none); ``losses[i]`` is step ``start_step + i``.

    The steps in ``skipped`` are left out: their updates were discarded (a batch the grad-norm or loss detector
    judged abnormal), so their loss is the batch's, not the model's, and one poisoned batch near the end would
    otherwise make a healthy end look degraded."""
    return final_stats(losses, window, start_step=start_step, skipped=skipped)[0]


def final_stats(
    losses: Sequence[float], window: int, *, start_step: int = 0, skipped: Collection[int] = ()
) -> tuple[float | None, float]:
    """``final_loss`` and its standard error over the same losses, in one pass (the error is 0 with fewer than two
    losses): how far below a figure the final loss may sit by chance alone."""
    skip = set(skipped)
    finite = [x for i, x in enumerate(losses) if math.isfinite(x) and start_step + i not in skip]
    tail = finite[-window:]
    if not tail:
        return None, 0.0
    sem = statistics.stdev(tail) / math.sqrt(len(tail)) if len(tail) > 1 else 0.0
    return sum(tail) / len(tail), sem


def progress(value: float, initial: float | None, floor: float | None) -> float | None:
    """Fraction of the way from ``initial`` down to ``floor`` (0 when unknown) that ``value`` has covered."""
    if initial is None or not math.isfinite(initial):
        return None
    target = floor if floor is not None and math.isfinite(floor) and floor < initial else 0.0
    gap = initial - target
    if gap <= 0.0:
        return None
    return (initial - value) / gap


def _way(ev: Evidence) -> tuple[float | None, str]:
    """Where the progress rules measure the way to, and its name for a reason: the data's loss floor; where none
    is known (a user's data), what ignoring the inputs scores, the trivial loss (None when the initial loss is not
    above it: the way is unknown, and only the trivial-loss rule judges); with neither, 0. Toward 0 a hard task
    asks more than it can give: a classifier on noisy labels that ends at 0.56 from a coin toss's 0.69 covered 19%
    of that way, and was called never learned."""
    if ev.loss_floor is not None:
        return ev.loss_floor, f"the floor {_fmt(ev.loss_floor)}"
    if ev.trivial_loss is not None:
        above = ev.initial_loss is not None and ev.initial_loss > ev.trivial_loss
        return (ev.trivial_loss if above else None), f"what ignoring the inputs scores, {_fmt(ev.trivial_loss)}"
    return 0.0, "its floor"


def _progress(value: float, ev: Evidence) -> float | None:
    """``progress`` of ``value`` along the way ``_way`` names (None: unknown)."""
    target, _ = _way(ev)
    return None if target is None else progress(value, ev.initial_loss, target)


def early_check_step(cfg: Success, *, max_steps: int, warmup_steps: int) -> int:
    """The step at which a run that has not started learning is stopped as never learned."""
    return min(max_steps - 1, max(int(cfg.early_check_fraction * max_steps), 3 * warmup_steps))


def stall_steps(cfg: Success, *, max_steps: int, ema_alpha: float) -> int | None:
    """How long the best smoothed loss may go without improving before a run far from its floor has stalled:
    ``stall_fraction`` of the run, and at least two horizons (1/alpha) of the EMA that smooths it, since the
    smoothed loss itself lags the loss by about one. None: the rule is off."""
    if cfg.stall_fraction is None:
        return None
    return max(int(cfg.stall_fraction * max_steps), math.ceil(2.0 / ema_alpha))


def progress_mark(mark: tuple[int, float] | None, *, best_step: int | None, best_loss: float | None,
                  initial: float | None, floor: float | None, min_gain: float) -> tuple[int, float] | None:
    """The stall clock's start, as ``(step, best smoothed loss)``: moved to the current best only when that is
    below the mark by at least ``min_gain`` of the way from ``initial`` down to ``floor`` (any new best when
    ``min_gain`` is 0 or that way is unknown). The first best sets it. Call it after every step."""
    if best_step is None or best_loss is None:
        return mark
    if mark is None:
        return best_step, best_loss
    known = initial is not None and floor is not None and math.isfinite(initial) and initial > floor
    need = min_gain * (initial - floor) if known and initial is not None and floor is not None else 0.0
    return (best_step, best_loss) if best_loss < mark[1] - need else mark


@dataclass
class StallClock:
    """The lineage's stall clock, checkpointed with it: where the last improvement that counted was
    (``progress_mark``) and the longest the lineage went without one while short of ``stall_max_progress``.

    While an attempt runs, the stall rule grants a resumed one a whole window of its own; at the end the lineage
    is judged as a whole, and a lineage that once stood still for a whole window, far from its floor, is not made
    healthy by a resume that crept a little lower in the steps left (the baseline's restarts from the newest
    checkpoint of the development half's warmup plateau: the last crept on as the cosine decayed the LR and ended
    SUCCEEDED at 1.96x its reference).
    """

    mark: tuple[int, float] | None = None
    longest: int = 0
    """The most steps the mark stood still while the best was short of the bar; ``longest_from`` is its step."""
    longest_from: int = 0

    def tick(self, step: int, *, best_step: int | None, best_loss: float | None, initial: float | None,
             floor: float | None, min_gain: float, max_progress: float) -> None:
        """Call after every step (``step`` completed steps)."""
        self.mark = progress_mark(self.mark, best_step=best_step, best_loss=best_loss, initial=initial, floor=floor,
                                  min_gain=min_gain)
        if self.mark is None or best_loss is None or step - self.mark[0] <= self.longest:
            return
        p = progress(best_loss, initial, floor)
        if p is not None and p < max_progress:
            self.longest, self.longest_from = step - self.mark[0], self.mark[0]

    def state_dict(self) -> dict[str, Any]:
        return {"mark": None if self.mark is None else list(self.mark), "longest": self.longest,
                "longest_from": self.longest_from}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        mark = state.get("mark")
        self.mark = None if mark is None else (int(mark[0]), float(mark[1]))
        self.longest, self.longest_from = int(state.get("longest", 0)), int(state.get("longest_from", 0))


def judge_stall(cfg: Success, ev: Evidence, *, step: int, patience: int, at_end: bool = False) -> Verdict:
    """The stall rule (module docstring) at ``step`` (completed steps), with ``patience`` from ``stall_steps``,
    counted from the best step or, while an attempt that resumed after it runs, from the resume (a retry gets a
    whole window to improve on the lineage's best). ``at_end``: the lineage is judged as a whole, without that
    grace: an attempt resumed too close to the end to be judged while it ran cannot end a stalled lineage as a
    success, nor can one that crept lower after the lineage had once stood still for a whole window
    (``stalled_for``) if it ends still short of the bar. The onset is the attempt's start, or the lineage's
    (step 0) when the stall began before it."""
    if ev.loss_floor is None or ev.best_loss is None or ev.best_step is None:
        return Verdict(None, "no floor or no smoothed loss")
    since = ev.best_step if ev.progress_step is None else min(ev.progress_step, ev.best_step)
    now = step - (since if at_end else max(since, ev.start_step)) >= patience
    if not now and not (at_end and ev.stalled_for >= patience):
        return Verdict(None, "improving")
    p = progress(ev.best_loss, ev.initial_loss, ev.loss_floor)
    if p is None or p >= cfg.stall_max_progress:
        return Verdict(None, "improving or near the floor")
    if ev.vanishing:  # stalled because the gradients vanished: the diagnosis that no LR retry is spent on
        return _vanishing(ev.best_loss, p, ev, cfg.stall_max_progress, f"by step {step} the best smoothed loss")
    gain = f"improved by less than {cfg.stall_min_gain:.0%} of the way to the floor"
    best = f"the best smoothed loss {_fmt(ev.best_loss)} (step {ev.best_step})"
    if now:
        began = ev.best_step
        what = (f"{best} has not improved for {step - since} steps" if since == ev.best_step else
                f"{best} has {gain} for {step - since} steps (since step {since})")
    else:
        began = ev.stalled_from
        what = (f"the lineage once {gain} for {ev.stalled_for} steps (from step {ev.stalled_from}) and {best} "
                "is still short")
    return Verdict(
        STALLED,
        f"stalled: {what}, {p:.0%} of the way from the initial {_fmt(ev.initial_loss)} to the floor "
        f"{_fmt(ev.loss_floor)} (a run may level off only past {cfg.stall_max_progress:.0%})",
        value=ev.best_loss, threshold=_threshold(ev, cfg.stall_max_progress),
        onset_step=ev.start_step if began >= ev.start_step else 0,
    )


def collapse_window(ema_alpha: float) -> int:
    """The steps the gradient-collapse rule takes its medians over: the loss EMA's horizon (1/alpha; 20 steps with
    the default), the span over which the smoothed loss itself is judged."""
    return math.ceil(1.0 / ema_alpha)


def judge_collapse(cfg: Success, *, step: int, max_steps: int, baseline_norm: float | None,
                   norms: Sequence[float], losses: Sequence[float], initial_loss: float | None,
                   loss_floor: float | None) -> Verdict:
    """The gradient-collapse rule (module docstring) after ``step`` completed steps of a fresh start:
    ``baseline_norm`` is the median gradient norm of its first steps (None: not yet known), ``norms`` and
    ``losses`` the finite pre-clip norms and losses of its last ``collapse_window`` steps (the norms of steps whose
    update was discarded left out)."""
    ratio_bar = cfg.collapse_ratio
    if ratio_bar is None or loss_floor is None or baseline_norm is None or baseline_norm <= 0.0:
        return Verdict(None, "off")
    if step > max_steps // 2 or not norms or not losses:
        return Verdict(None, "outside the window")
    norm = statistics.median(norms)
    ratio = norm / baseline_norm
    if ratio >= ratio_bar:
        return Verdict(None, "gradients at their scale")
    loss = statistics.median(losses)
    p = progress(loss, initial_loss, loss_floor)
    if p is None or p >= cfg.collapse_max_progress:
        return Verdict(None, "gradients shrank with the loss")
    return Verdict(
        COLLAPSED,
        f"collapsed: by step {step} the median gradient norm {_fmt(norm)} of the last {len(norms)} steps is "
        f"{ratio:.2f}x its first steps' {_fmt(baseline_norm)} (a collapse below {ratio_bar:g}x) while their median "
        f"loss {_fmt(loss)} covered {p:.1%} of the way from the initial {_fmt(initial_loss)} to the floor "
        f"{_fmt(loss_floor)} (under {cfg.collapse_max_progress:.0%}): a flat region far from a minimum",
        value=ratio, threshold=ratio_bar, onset_step=0,
    )


def _fmt(x: float | None) -> str:
    return "?" if x is None else f"{x:.4g}"


def judge_progress(cfg: Success, *, smoothed_loss: float, ev: Evidence, step: int) -> Verdict:
    """The early check: has the run covered ``early_min_progress`` of the way to the floor by ``step``?"""
    p = _progress(smoothed_loss, ev)
    if p is None or cfg.early_min_progress == 0.0 or p >= cfg.early_min_progress:
        return Verdict(None, "learning")
    if ev.vanishing:  # the same diagnosis as at the end: no LR or clip retry can help, so do not spend one
        return _vanishing(smoothed_loss, p, ev, cfg.early_min_progress, f"by step {step} the smoothed loss")
    _, floor = _way(ev)
    return Verdict(
        NEVER_LEARNED,
        f"never learned: by step {step} the smoothed loss {_fmt(smoothed_loss)} covered {p:.0%} of the way from "
        f"the initial {_fmt(ev.initial_loss)} to {floor} (needs {cfg.early_min_progress:.0%})",
        value=smoothed_loss, threshold=_threshold(ev, cfg.early_min_progress), onset_step=ev.start_step,
    )


def _vanishing(value: float, p: float, ev: Evidence, share: float, what: str) -> Verdict:
    """The vanishing diagnosis (the detector fired and the loss made no real progress), at the end or early."""
    finding = (f"{what} {_fmt(value)} covered {p:.0%} of the way from the initial {_fmt(ev.initial_loss)} to "
               f"{_way(ev)[1]}")
    return _vanishing_verdict(finding, value=value, threshold=_threshold(ev, share), onset=ev.start_step)


def _vanishing_verdict(finding: str, *, value: float, threshold: float | None, onset: int) -> Verdict:
    """The vanishing diagnosis with what the numbers showed (``finding``) and the advice: no retry can help."""
    return Verdict(
        VANISHING,
        f"vanishing gradients: {finding}; tightening the LR or clip cannot fix vanishing gradients "
        "(change the activation, the initialisation, normalisation or residual connections)",
        value=value, threshold=threshold, onset_step=onset,
    )


def _threshold(ev: Evidence, share: float) -> float | None:
    target, _ = _way(ev)
    if ev.initial_loss is None or target is None:
        return None
    target = target if target < ev.initial_loss else 0.0
    return ev.initial_loss - share * (ev.initial_loss - target)


def _no_better_than_trivial(cfg: Success, ev: Evidence, final: float) -> Verdict | None:
    """``never_learned`` (or vanishing) when the final loss is no better than the trivial loss, within the noise;
    None otherwise, or when the trivial loss is unknown or the progress rules are off."""
    if ev.trivial_loss is None or cfg.min_progress == 0.0:
        return None
    margin = TRIVIAL_MARGIN_SE * ev.final_sem
    if final < ev.trivial_loss - margin:
        return None
    what = (f"the final loss {_fmt(final)} is no better than {_fmt(ev.trivial_loss)}, the loss of a prediction "
            "that ignores the inputs")
    if final < ev.trivial_loss:
        what += f" (within the noise: {TRIVIAL_MARGIN_SE:g} standard errors of the final loss, {_fmt(margin)})"
    if ev.vanishing:
        return _vanishing_verdict(what, value=final, threshold=ev.trivial_loss, onset=ev.start_step)
    return Verdict(NEVER_LEARNED, f"never learned: {what} (its fall from the initial {_fmt(ev.initial_loss)} "
                   "learned nothing from them)", value=final, threshold=ev.trivial_loss, onset_step=ev.start_step)


def judge_end(cfg: Success, ev: Evidence, *, step: int | None = None, stall_patience: int | None = None) -> Verdict:
    """The verdict on an attempt that reached its last step (rules in the module docstring, in that order); the
    stall rule over the whole lineage (``judge_stall(at_end=True)``) when ``step`` and ``stall_patience`` are
    given."""
    final = ev.final_loss
    if final is None:
        return Verdict(DEGRADED, "no finite loss in the attempt's last steps", onset_step=ev.start_step)
    p = _progress(final, ev)
    learned = p is None or cfg.min_progress == 0.0 or p >= cfg.min_progress
    if ev.vanishing and not learned and p is not None:
        return _vanishing(final, p, ev, cfg.min_progress, "the final loss")
    if not learned:
        return Verdict(
            NEVER_LEARNED,
            f"never learned: the final loss {_fmt(final)} covered {p:.0%} of the way from the initial "
            f"{_fmt(ev.initial_loss)} to {_way(ev)[1]} (needs {cfg.min_progress:.0%})",
            value=final, threshold=_threshold(ev, cfg.min_progress), onset_step=ev.start_step,
        )
    trivial = _no_better_than_trivial(cfg, ev, final)
    if trivial is not None:
        return trivial
    if step is not None and stall_patience is not None:
        stalled = judge_stall(cfg, ev, step=step, patience=stall_patience, at_end=True)
        if not stalled.healthy:
            return stalled
    limit = None if ev.best_loss is None else (1.0 + cfg.regression_tolerance) * ev.best_loss + ev.noise_std
    if ev.best_loss is not None and ev.best_loss > 0 and limit is not None and final > limit:
        onset = ev.start_step if ev.best_step is None else max(ev.best_step + 1, 0)
        return Verdict(
            DEGRADED,
            f"degraded: the final loss {_fmt(final)} is {final / ev.best_loss:.2f}x the best smoothed loss "
            f"{_fmt(ev.best_loss)} (step {ev.best_step}); allowed up to {_fmt(limit)}",
            value=final, threshold=limit, onset_step=onset,
        )
    if ev.eval is not None and cfg.eval_regression_tolerance is not None:
        held_out = judge_eval(ev.eval, tolerance=cfg.eval_regression_tolerance, start_step=ev.start_step)
        if not held_out.healthy:
            return _overfitting(held_out, ev.eval, final, cfg.eval_regression_tolerance) or held_out
    if cfg.max_final_loss is not None and final > cfg.max_final_loss:
        return Verdict(
            ABOVE_BAR, f"the final loss {_fmt(final)} is above success.max_final_loss {_fmt(cfg.max_final_loss)}",
            value=final, threshold=cfg.max_final_loss, onset_step=ev.start_step,
        )
    held = "" if ev.eval is None else f"; eval loss {_fmt(ev.eval.final)}, best {_fmt(ev.eval.best)}"
    return Verdict(None, f"healthy: final loss {_fmt(final)}, best {_fmt(ev.best_loss)}{held}")


def _overfitting(held_out: Verdict, ev: EvalEvidence, final: float, tolerance: float) -> Verdict | None:
    """The held-out verdict (regressed, or never better than before any update) read as overfitting when the
    training loss fell by more than ``tolerance`` of itself since the eval loss was at its best: the model fits
    its training data at the held-out data's expense. None when it is not that (a non-finite eval loss, a training
    loss that did not fall, or its value there unknown)."""
    before = ev.train_at_best
    if before is None or not math.isfinite(ev.final) or final > (1.0 - tolerance) * before:
        return None
    where = "before any update" if not ev.best_step else f"at step {ev.best_step}"
    return Verdict(
        OVERFITTING,
        f"overfitting: the eval loss {_fmt(ev.final)} at step {ev.final_step} is above its best {_fmt(ev.best)} "
        f"({where}) while the training loss fell from {_fmt(before)} there to {_fmt(final)}: the model fits its "
        "training data at the held-out data's expense. A lower LR or clip threshold does not fix that; stop "
        f"earlier (the held-out loss was best {where}), regularise or add data",
        value=ev.final, threshold=held_out.threshold, onset_step=held_out.onset_step,
    )


def eval_regression_limit(best: float | None, tolerance: float) -> float | None:
    """The highest eval loss that is not a regression from ``best`` (None: no positive best to compare with)."""
    return None if best is None or best <= 0 else (1.0 + tolerance) * best


def judge_eval(ev: EvalEvidence, *, tolerance: float, start_step: int = 0) -> Verdict:
    """The held-out rules (module docstring): finite, not regressed from its best, better than at the start."""
    final, onset = ev.final, ev.best_step if ev.best_step is not None else start_step
    if not math.isfinite(final):
        return Verdict(EVAL_DEGRADED, f"eval degraded: the eval loss at step {ev.final_step} is not finite "
                       f"(best {_fmt(ev.best)} at step {ev.best_step})", threshold=ev.best, onset_step=onset)
    limit = eval_regression_limit(ev.best, tolerance)
    if limit is not None and ev.best is not None and final > limit:
        return Verdict(
            EVAL_DEGRADED,
            f"eval degraded: the eval loss {_fmt(final)} at step {ev.final_step} is {final / ev.best:.2f}x the "
            f"best eval loss {_fmt(ev.best)} (step {ev.best_step}); allowed up to {_fmt(limit)}",
            value=final, threshold=limit, onset_step=onset,
        )
    if ev.initial is not None and final >= ev.initial:
        return Verdict(
            NEVER_LEARNED,
            f"never learned (held out): the eval loss {_fmt(final)} at step {ev.final_step} is no better than "
            f"before any update ({_fmt(ev.initial)}), whatever the training loss shows",
            value=final, threshold=ev.initial, onset_step=start_step,
        )
    return Verdict(None, f"eval loss {_fmt(final)}, best {_fmt(ev.best)}")
