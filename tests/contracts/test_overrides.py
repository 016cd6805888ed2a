"""apply_overrides: dotted paths, [old, new] values, re-validation with field-named errors."""

from __future__ import annotations

import pytest

from contracts.overrides import apply_overrides
from contracts.recipe import Recipe, RecipeError


def test_applies_new_values_and_keeps_the_rest() -> None:
    base = Recipe(name="r")
    out = apply_overrides(
        base,
        {"optimizer.lr": [1e-3, 5e-4], "clipping.max_norm": [1.0, 0.25], "precision.dtype": ["fp32", "bf16"]},
    )
    assert out.optimizer.lr == 5e-4
    assert out.clipping.max_norm == 0.25
    assert out.precision.dtype.value == "bf16"
    assert out.training == base.training
    assert base.optimizer.lr == 1e-3  # the input is not mutated


def test_no_overrides_returns_the_recipe() -> None:
    base = Recipe(name="r")
    assert apply_overrides(base, {}) is base
    assert apply_overrides(base, None) is base


def test_list_index_path() -> None:
    base = Recipe.model_validate({"name": "r", "faults": [{"type": "nan_loss", "step": 5}]})
    assert apply_overrides(base, {"faults.0.step": [5, 7]}).faults[0].step == 7


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"optimizer.lrr": [1, 2]}, "optimizer.lrr: no such recipe field"),
        ({"optimizer.lr": [1e-3, -1.0]}, "optimizer.lr: Input should be greater than 0"),
        ({"optimizer.lr": [1, 2, 3]}, "optimizer.lr: override must be"),
        ({"optimizer.lr.x": [1, 2]}, "is not a section"),
    ],
)
def test_bad_overrides_name_the_field(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(RecipeError, match=message):
        apply_overrides(Recipe(name="r"), overrides)
