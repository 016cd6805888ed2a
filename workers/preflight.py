"""The preflight probe: does this attempt's setup work at all? Run before a run's first worker group starts.

``probe(spec, world_size)`` does what rank 0 of a ``world_size`` worker group does first, on CPU and without the
group: validate the spec (the allow-list again), import the factories, build the data source and the model
(``build_model`` checks a custom model's contract on batch 0), apply the block options, pull one batch and run
one forward. It is cheap next to a ``TorchTrainer`` start, and it runs as a small Ray task in the run's
``runtime_env`` (``orchestrator.channel.run_preflight``), so it imports what the workers will.

The answer is plain data (it crosses a process boundary): ``{"status": "ok"}``; ``{"status": "config_error",
"error": message}`` for a deterministic setup error (``SpecError``, ``RecipeError``, ``EngineConfigError``: the
message names the field), which fails the run without a retry; ``{"status": "inconclusive", "error": ...}`` for
anything else (a factory that fails for a reason of its own, a forward that runs out of memory), which says
nothing certain about the recipe: the attempt starts anyway and the recovery policy handles what happens.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from contracts.recipe import RecipeError
from contracts.wire import AttemptSpec, one_line
from workers.comm import EngineConfigError
from workers.data import SpecError, build_data
from workers.models import apply_distributed, build_model
from workers.objective import Objective

CONFIG_ERRORS: tuple[type[Exception], ...] = (SpecError, RecipeError, EngineConfigError)
"""Deterministic setup errors: the recipe cannot run as written, and no retry changes that."""

MESSAGE_LIMIT = 1000


def probe(spec: Mapping[str, Any], world_size: int = 1) -> dict[str, Any]:
    """Build rank 0's data and model for ``spec`` (an ``AttemptSpec`` dict) and run one forward; see the module
    docstring for the answer."""
    try:
        _setup(spec, world_size)
    except CONFIG_ERRORS as exc:
        return {"status": "config_error", "error": one_line(exc, MESSAGE_LIMIT)}
    except Exception as exc:  # noqa: BLE001 - anything else is not known to be the recipe's fault
        return {"status": "inconclusive", "error": one_line(f"{type(exc).__name__}: {exc}", MESSAGE_LIMIT)}
    return {"status": "ok", "error": None}


def _setup(raw: Mapping[str, Any], world_size: int) -> None:
    spec = AttemptSpec.from_dict(raw)
    r = spec.recipe
    allowed = spec.allowed_import_modules
    data = build_data(r.data, seed=r.training.seed, batch_size=r.training.batch_size, rank=0,
                      world_size=max(1, world_size), allowed_import_modules=allowed)
    model = apply_distributed(build_model(r.model, data, seed=r.training.seed, allowed_import_modules=allowed,
                                          loss=r.loss), r.distributed)
    with torch.no_grad():  # the same call convention and loss as the training step (workers/objective.py)
        Objective(model, r.loss).loss(data.batch(0))
