"""The LR schedule: warmup, the three decay shapes, the floor, re-warm after a rollback, bad input."""

from __future__ import annotations

import math

import pytest

from contracts.recipe import Schedule
from workers.schedule import lr_at


def sched(**kw: object) -> Schedule:
    return Schedule.model_validate(kw)


def test_linear_warmup_reaches_peak_on_last_warmup_step() -> None:
    s = sched(warmup_steps=10, decay="constant")
    lrs = [lr_at(i, base_lr=1.0, max_steps=100, schedule=s) for i in range(12)]
    assert lrs[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert lrs[10] == lrs[11] == 1.0


def test_no_warmup_starts_at_peak() -> None:
    assert lr_at(0, base_lr=3e-4, max_steps=10, schedule=sched(decay="linear")) == pytest.approx(3e-4)


@pytest.mark.parametrize(
    ("decay", "mid"),
    [("cosine", 0.1 + 0.9 * 0.5), ("linear", 1.0 - 0.9 * 0.5), ("constant", 1.0)],
)
def test_decay_shapes_from_peak_to_floor(decay: str, mid: float) -> None:
    s = sched(warmup_steps=10, decay=decay, min_lr_ratio=0.1)

    def f(i: int) -> float:
        return lr_at(i, base_lr=1.0, max_steps=110, schedule=s)

    assert f(10) == pytest.approx(1.0)
    assert f(60) == pytest.approx(mid)
    end = 1.0 if decay == "constant" else 0.1
    assert f(110) == pytest.approx(end)
    assert f(500) == pytest.approx(end)  # past max_steps: stays at the floor
    after = [f(i) for i in range(10, 111)]
    assert all(a >= b - 1e-12 for a, b in zip(after, after[1:], strict=False))


def test_cosine_quarter_point() -> None:
    s = sched(decay="cosine", min_lr_ratio=0.0)
    assert lr_at(25, base_lr=2.0, max_steps=100, schedule=s) == pytest.approx(2.0 * 0.5 * (1 + math.cos(math.pi / 4)))


def test_warmup_fraction_and_preset() -> None:
    s = sched(preset="pretrain")  # warmup_fraction 0.05, cosine, min ratio 0.1
    assert lr_at(0, base_lr=1.0, max_steps=200, schedule=s) == pytest.approx(0.1)
    assert lr_at(9, base_lr=1.0, max_steps=200, schedule=s) == pytest.approx(1.0)
    assert lr_at(200, base_lr=1.0, max_steps=200, schedule=s) == pytest.approx(0.1)


def test_rewarm_multiplies_the_schedule_after_a_rollback() -> None:
    s = sched(warmup_steps=5, decay="linear", min_lr_ratio=0.0)
    kw = {"base_lr": 1.0, "max_steps": 105, "schedule": s}
    for step in range(40, 60):
        plain = lr_at(step, **kw)  # type: ignore[arg-type]
        warmed = lr_at(step, rewarm_start=45, rewarm_steps=10, **kw)  # type: ignore[arg-type]
        if 45 <= step < 55:
            assert warmed == pytest.approx(plain * (step - 45 + 1) / 10)
        else:
            assert warmed == pytest.approx(plain)
    assert lr_at(45, rewarm_start=45, rewarm_steps=0, **kw) == lr_at(45, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kw", "field"),
    [
        ({"step": -1}, "step"),
        ({"max_steps": 0}, "max_steps"),
        ({"base_lr": float("nan")}, "base_lr"),
        ({"rewarm_steps": -2}, "rewarm_steps"),
    ],
)
def test_bad_input_names_the_argument(kw: dict[str, float], field: str) -> None:
    args = {"step": 0, "base_lr": 1.0, "max_steps": 10, "schedule": sched(), **kw}
    with pytest.raises(ValueError, match=field):
        lr_at(**args)  # type: ignore[arg-type]
