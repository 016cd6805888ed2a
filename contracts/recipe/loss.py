"""The ``loss:`` section: how a model's outputs become the scalar the loop minimises.

Left out (``name: model``), the model's own loss is used: a Hugging Face model's ``outputs.loss`` (it needs
``labels`` in the batch) or the scalar a built-in model's ``forward((inputs, targets))`` returns. With a loss, the
model is called on the inputs alone (``model(inputs)``, or ``model(**batch)`` for dict batches) and the loss
compares its outputs with the targets (``batch["labels"]`` for dict batches), always in float32.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Discriminator, Field, StrictFloat, StrictInt, Tag

from contracts.recipe.base import Section, name_tag
from contracts.recipe.imports import ImportString


class ModelLoss(Section):
    """The model's own loss: ``outputs.loss`` / ``outputs["loss"]``, or a scalar tensor returned by forward."""

    name: Literal["model"] = "model"


class CrossEntropyLoss(Section):
    """Cross-entropy of logits ``[..., C]`` (or ``outputs.logits``) against integer targets ``[...]``, flattened."""

    name: Literal["cross_entropy"] = "cross_entropy"
    label_smoothing: StrictFloat = Field(default=0.0, ge=0.0, lt=1.0)
    """Label smoothing (0 = none)."""
    ignore_index: StrictInt = -100
    """Target value that contributes nothing (padding)."""


class MSELoss(Section):
    """Mean squared error between the outputs and the targets (same shape)."""

    name: Literal["mse"] = "mse"


class CustomLoss(Section):
    """A user loss from an import string; the module must be on the operator's allow-list."""

    name: Literal["custom"] = "custom"
    function: ImportString
    """`module:function` called as ``fn(outputs, targets)`` (``fn(outputs, batch)`` for dict batches), returning a
    scalar tensor."""


LossSpec = Annotated[
    Annotated[ModelLoss, Tag("model")]
    | Annotated[CrossEntropyLoss, Tag("cross_entropy")]
    | Annotated[MSELoss, Tag("mse")]
    | Annotated[CustomLoss, Tag("custom")],
    Discriminator(
        name_tag("model"),
        custom_error_type="invalid_name",
        custom_error_message="unknown loss name; expected one of: model, cross_entropy, mse, custom",
    ),
]
