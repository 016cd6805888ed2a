"""What every recipe section shares: the strict base model, the document constants, union tagging."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

API_VERSION: Literal["ballast/v1"] = "ballast/v1"
KIND: Literal["StabilityRecipe"] = "StabilityRecipe"
DEFAULT_MAX_RECIPE_BYTES = 256 * 1024
MODEL_NAMES = ("tiny_gpt", "deep_mlp", "rnn", "linear", "custom", "hf_causal_lm")
DATA_NAMES = ("markov", "regression", "sequence", "custom", "dataset", "tokens_file")
LOSS_NAMES = ("model", "cross_entropy", "mse", "custom")


class Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", use_attribute_docstrings=True, populate_by_name=True, allow_inf_nan=False
    )


def name_tag(default: str) -> Callable[[Any], str | None]:
    """Discriminate on ``name``, defaulting to ``default`` when the section omits it."""

    def tag(value: Any) -> str | None:
        if isinstance(value, dict):
            name = value.get("name", default)
            return name if isinstance(name, str) else None
        return getattr(value, "name", None)

    return tag
