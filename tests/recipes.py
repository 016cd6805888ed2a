"""The tests' one recipe builder: a base document with sections merged over it, as a dict or a validated Recipe.

Each test module keeps its own base document (its golden curves and timings depend on its exact sizes) and binds
it once, e.g. ``make_recipe = partial(build_recipe, BASE)``; then ``make_recipe(optimizer={"lr": 1e-3})``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from contracts.recipe import Recipe, validate_recipe_data

MINIMAL: dict[str, Any] = {"name": "t"}
"""Every section left to its default."""


def recipe_doc(base: Mapping[str, Any] = MINIMAL, /, **sections: Any) -> dict[str, Any]:
    """A copy of ``base`` with each keyword merged in one level deep: a mapping updates that section key by key
    (``training={"max_steps": 40}`` keeps the base's batch size); anything else (``name``, a ``faults`` list)
    replaces it. ``base`` is never modified."""
    doc = copy.deepcopy(dict(base))
    for key, value in sections.items():
        current = doc.get(key)
        if isinstance(value, Mapping) and isinstance(current, Mapping):
            doc[key] = {**current, **copy.deepcopy(dict(value))}
        else:
            doc[key] = copy.deepcopy(value)
    return doc


def build_recipe(base: Mapping[str, Any] = MINIMAL, /, **sections: Any) -> Recipe:
    """``recipe_doc(base, **sections)`` validated as a recipe (RecipeError names each bad field)."""
    return validate_recipe_data(recipe_doc(base, **sections))


EXPLODING_RNN: dict[str, Any] = {
    "name": "exploding-rnn",
    "model": {"name": "rnn", "cell": "rnn", "hidden": 32, "recurrent_spectral_radius": 1.1},
    "data": {"name": "sequence", "task": "running_sum", "seq_len": 32, "dim": 4},
    "training": {"max_steps": 40, "batch_size": 16, "seed": 0},
    "optimizer": {"name": "sgd", "lr": 1.0, "momentum": 0.9},
    "schedule": {"warmup_steps": 0},
    "clipping": {"method": "none"},
    "checkpoint": {"every_steps": 10},
    "success": {"min_progress": 0.0, "early_min_progress": 0.0},
}
"""A tanh RNN at the edge of chaos (recurrent radius 1.1) under momentum SGD at lr 1.0 without clipping: it blows
up within a few steps, and a probe of the LRs 0.25, 0.0625 and 0.0156 from initialisation sees 0.25 blow up again
and the other two train (the LR probe's tests). Short runs: no bar on the model's progress."""


SLOW_LSTM: dict[str, Any] = {
    "name": "slow-lstm",
    "model": {"name": "rnn", "cell": "lstm", "hidden": 32},
    "data": {"name": "sequence", "task": "copy", "seq_len": 16, "dim": 4},
    "training": {"max_steps": 150, "batch_size": 16, "seed": 7},
    "optimizer": {"name": "adam", "lr": 0.001},
    "schedule": {"warmup_steps": 0, "decay": "cosine"},
    "checkpoint": {"every_steps": 25},
}
"""An LSTM on the copy task at Adam 1e-3: too low an LR to learn anything in 150 steps (4e-3 and above learn)."""
