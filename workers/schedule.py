"""The learning-rate schedule: linear warmup, then cosine / linear / constant decay, plus re-warm after a rollback.

A pure function of the step, so a resumed attempt computes exactly the LR the straight run would have (no
scheduler object to checkpoint) and a rollback can re-warm from any step without rebuilding state.
"""

from __future__ import annotations

import math

from contracts.recipe import Decay, Schedule


def lr_at(
    step: int,
    *,
    base_lr: float,
    max_steps: int,
    schedule: Schedule,
    rewarm_start: int | None = None,
    rewarm_steps: int = 0,
) -> float:
    """The learning rate for 0-based optimizer ``step``.

    - Warmup (``step < W``, ``W = schedule.resolved_warmup_steps(max_steps)``): ``base_lr * (step + 1) / W``, so
      step 0 already trains and step ``W - 1`` reaches the peak.
    - Decay from ``base_lr`` at step ``W`` to ``base_lr * min_lr_ratio`` at step ``max_steps`` (cosine or linear);
      steps past ``max_steps`` stay at the floor. ``constant`` keeps ``base_lr`` and ignores ``min_lr_ratio``.
    - Re-warm after a rollback: for ``rewarm_start <= step < rewarm_start + rewarm_steps`` the scheduled LR is
      multiplied by ``(step - rewarm_start + 1) / rewarm_steps``; Adam's moments restored from a checkpoint
      taken before the divergence are stale for the tightened settings, so the retry eases back in.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if max_steps < 1:
        raise ValueError(f"max_steps must be >= 1, got {max_steps}")
    if not (math.isfinite(base_lr) and base_lr >= 0.0):
        raise ValueError(f"base_lr must be a finite number >= 0, got {base_lr}")
    if rewarm_steps < 0:
        raise ValueError(f"rewarm_steps must be >= 0, got {rewarm_steps}")

    warmup = schedule.resolved_warmup_steps(max_steps)
    if step < warmup:
        lr = base_lr * (step + 1) / warmup
    else:
        decay = Decay(schedule.decay)
        floor = base_lr * schedule.min_lr_ratio
        span = max_steps - warmup
        progress = 1.0 if span <= 0 else min(1.0, (step - warmup) / span)
        if decay is Decay.constant:
            lr = base_lr
        elif decay is Decay.linear:
            lr = base_lr - (base_lr - floor) * progress
        else:
            lr = floor + (base_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    if rewarm_start is not None and rewarm_steps > 0 and rewarm_start <= step < rewarm_start + rewarm_steps:
        lr *= (step - rewarm_start + 1) / rewarm_steps
    return lr
