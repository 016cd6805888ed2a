"""Data sources behind one contract: ``batch(index)`` is a pure function of (spec, seed, rank, world size, index).

- ``base``: ``DataSource``, ``SpecError``, seeding, the import rule;
- ``synthetic``: the built-in ``markov``, ``regression`` and ``sequence`` data with known loss floors;
- ``custom``: ``factory(index, batch_size, seed, **params) -> (inputs, targets)``;
- ``dataset``: a ``torch.utils.data.Dataset`` factory, through the seeded resumable ``sampler``;
- ``tokens``: a local token (or text + tokenizer) file, for language models;
- ``batch``: tuple and dict batches (device moves, input perturbations).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from contracts.recipe import CustomData, DatasetData, DataSpec, MarkovData, RegressionData, SequenceData, TokensFileData
from workers.data.base import (
    DataDims,
    DataKind,
    DataSource,
    SpecError,
    _spec_key,
    module_allowed,
    resolve_import,
    stream_seed,
)
from workers.data.batch import Batch, has_float_inputs, scale_float_inputs, to_device
from workers.data.custom import CustomSource
from workers.data.dataset import DatasetSource
from workers.data.sampler import SeededSampler
from workers.data.synthetic import MarkovSource, RegressionSource, SequenceSource
from workers.data.tokens import TokensFileSource

__all__ = [
    "Batch", "CustomSource", "DataDims", "DataKind", "DataSource", "DatasetSource", "MarkovSource",
    "RegressionSource", "SeededSampler", "SequenceSource", "SpecError", "TokensFileSource", "_spec_key",
    "build_data", "has_float_inputs", "module_allowed", "resolve_import", "scale_float_inputs", "stream_seed",
    "to_device",
]


def build_data(
    spec: DataSpec,
    *,
    seed: int,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    allowed_import_modules: Sequence[str] = (),
) -> DataSource:
    """The recipe's ``data`` section → this rank's ``DataSource`` (``seed`` is ``training.seed``)."""
    kw: dict[str, Any] = {"seed": seed, "batch_size": batch_size, "rank": rank, "world_size": world_size}
    if isinstance(spec, MarkovData):
        return MarkovSource(spec, **kw)
    if isinstance(spec, RegressionData):
        return RegressionSource(spec, **kw)
    if isinstance(spec, SequenceData):
        return SequenceSource(spec, **kw)
    if isinstance(spec, CustomData):
        return CustomSource(spec, allowed_import_modules=allowed_import_modules, **kw)
    if isinstance(spec, DatasetData):
        return DatasetSource(spec, allowed_import_modules=allowed_import_modules, **kw)
    if isinstance(spec, TokensFileData):
        return TokensFileSource(spec, **kw)
    raise SpecError(f"data.name: unknown data spec {type(spec).__name__}")
