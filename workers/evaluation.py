"""Held-out evaluation bookkeeping: when an eval is due, and what the lineage's eval series has shown.

The trainer computes the eval loss (``GuardedTrainer._evaluate``: the same ``training.eval_batches`` held-out
batches every time, on every rank, averaged over ranks with one all-gather, so every rank holds the same number
and so makes the same verdict). This module keeps the series' summary the verdict and the checkpoint health read:
the lineage's first eval loss (before any update), its best and the newest. The summary travels with the checkpoint
like the loss detector's state, so a resumed attempt judges its eval loss against the best of the whole lineage.

Torch-free: numbers in, numbers out.
"""

from __future__ import annotations

import math
from typing import Any

from contracts.wire import finite_or_none
from workers.verdict import EvalEvidence

STATE_VERSION = 1


def eval_due(completed_steps: int, interval: int) -> bool:
    """Whether the weights after ``completed_steps`` updates are evaluated on the regular schedule."""
    return interval > 0 and completed_steps % interval == 0


class EvalHistory:
    """The lineage's eval losses as the verdict needs them: first (at step 0), best (lowest finite), newest."""

    def __init__(self) -> None:
        self.initial: float | None = None
        self.best: float | None = None
        self.best_step: int | None = None
        self.last: float | None = None
        """The newest eval loss, NaN when it was not finite; None before the first eval."""
        self.last_step: int | None = None

    def observe(self, step: int, value: float) -> None:
        """Record the eval loss of the weights after ``step`` completed updates (NaN/inf: not finite)."""
        finite = math.isfinite(value)
        if step == 0 and self.initial is None and finite:
            self.initial = value
        if finite and (self.best is None or value < self.best):
            self.best, self.best_step = value, step
        self.last, self.last_step = (value if finite else math.nan), step

    def evidence(self) -> EvalEvidence | None:
        """The verdict's view of the series; None before the first eval."""
        if self.last is None or self.last_step is None:
            return None
        return EvalEvidence(initial=self.initial, best=self.best, best_step=self.best_step, final=self.last,
                            final_step=self.last_step)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able (finite floats or None)."""
        return {"version": STATE_VERSION, "initial": self.initial, "best": self.best, "best_step": self.best_step,
                "last": finite_or_none(self.last), "last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"eval history: version {state.get('version')!r}, expected {STATE_VERSION}")

        def opt_float(key: str) -> float | None:
            v = state.get(key)
            return None if v is None else float(v)

        def opt_int(key: str) -> int | None:
            v = state.get(key)
            return None if v is None else int(v)

        self.initial, self.best, self.best_step = opt_float("initial"), opt_float("best"), opt_int("best_step")
        self.last_step = opt_int("last_step")
        last = opt_float("last")
        self.last = math.nan if last is None and self.last_step is not None else last
