"""User data by batch index: ``factory(index, batch_size, seed, **params) -> (inputs, targets)``."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from contracts.recipe import CustomData
from workers.data.base import TARGETS_READ_LIMIT, DataSource, SpecError, resolve_import, stream_seed

TARGET_BATCHES_LIMIT = 64
"""At most this many batches are read for the trivial loss (``CustomSource.training_targets``)."""


# ------------------------------------------------------------------------------------------------- custom
class CustomSource(DataSource):
    """User data: ``factory(index, batch_size, seed, **params) -> (inputs, targets)``.

    ``seed`` passed to the factory is already mixed with the rank and the stream (train/eval), so a factory that
    seeds its own generator from it is deterministic per (seed, rank, index) and eval batches are disjoint.
    Dimensions are read off training batch 0: integer inputs → tokens, 2-D float → features, 3-D float → sequence.
    """

    def __init__(
        self,
        spec: CustomData,
        *,
        seed: int,
        batch_size: int,
        rank: int,
        world_size: int,
        allowed_import_modules: Sequence[str],
    ) -> None:
        super().__init__(spec, seed=seed, batch_size=batch_size, rank=rank, world_size=world_size)
        self._factory = resolve_import(spec.factory, allowed_import_modules, field="data.factory")
        self._params = dict(spec.params)
        inputs, targets = self._make(self._generator("train", 0), 0, "train")
        if not inputs.is_floating_point():
            self.kind = "tokens"
            self.seq_len = int(inputs.shape[1]) if inputs.ndim >= 2 else None
        else:
            if inputs.ndim not in (2, 3):
                raise SpecError(f"data.factory: float inputs must be 2-D or 3-D, got shape {tuple(inputs.shape)}")
            self.kind = "features" if inputs.ndim == 2 else "sequence"
            self.input_dim = int(inputs.shape[-1])
            self.output_dim = int(targets.shape[-1]) if targets.ndim == inputs.ndim else 1
            self.seq_len = int(inputs.shape[1]) if inputs.ndim == 3 else None

    def training_targets(self) -> Tensor | None:
        """The targets of rank 0's first training batches, up to ``TARGETS_READ_LIMIT`` rows and
        ``TARGET_BATCHES_LIMIT`` batches: every rank calls the factory with rank 0's seed, so all measure the same
        rows (a factory is a pure function of its arguments). The first batches stand for the stream as a
        Dataset's seeded sample does for its items. A batch the factory cannot make ends the reading (a short run
        may never ask for it); None when none was read or their shapes do not stack."""
        parts: list[Tensor] = []
        rows = 0
        for index in range(TARGET_BATCHES_LIMIT):
            if rows >= TARGETS_READ_LIMIT:
                break
            try:
                targets = self._make(self._generator("train", index), index, "train", rank=0)[1]
            except SpecError:
                break
            parts.append(targets)
            rows += len(targets)
        try:
            return torch.cat(parts) if parts else None
        except RuntimeError:  # batches of different shapes (variable sequence lengths): unknown
            return None

    def _make(self, gen: torch.Generator, index: int, stream: str, rank: int | None = None) -> tuple[Tensor, Tensor]:
        seed = stream_seed(self._key, self.seed, self.rank if rank is None else rank, stream, "custom")
        try:
            out = self._factory(index, self.batch_size, seed, **self._params)
        except Exception as exc:
            raise SpecError(f"data.factory: {self.spec.factory} raised {type(exc).__name__}: {exc}") from exc
        if (
            not isinstance(out, tuple | list)
            or len(out) != 2
            or not all(isinstance(t, Tensor) for t in out)
        ):
            raise SpecError("data.factory: must return a pair of tensors (inputs, targets)")
        inputs, targets = out
        if inputs.ndim == 0 or targets.ndim == 0 or inputs.shape[0] != targets.shape[0]:
            raise SpecError(
                f"data.factory: inputs and targets need the same leading batch dimension, got "
                f"{tuple(inputs.shape)} and {tuple(targets.shape)}"
            )
        return inputs, targets
