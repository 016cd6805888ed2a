"""A ``torch.utils.data.Dataset`` as a data source: the seeded sampler, ``default_collate``, a held-out split.

``data: {name: dataset, factory: "pkg.mod:fn", params: {...}}``: the factory returns a map-style Dataset (anything
with ``__len__`` and ``__getitem__``). Batch ``index`` is the collated items ``SeededSampler.indices(index)``;
``(inputs, targets)`` items give tuple batches, dict items give dict batches. The eval stream is
``eval_factory``'s dataset, or a seeded random ``eval_fraction`` of the items held out of training (disjoint).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset, Subset, TensorDataset, default_collate

from contracts.recipe import DatasetData
from workers.data.base import TARGETS_READ_LIMIT, DataKind, DataSource, SpecError, resolve_import, stream_seed
from workers.data.batch import Batch
from workers.data.sampler import SeededSampler


def _check_dataset(ds: Any, field: str) -> Dataset[Any]:
    if not (hasattr(ds, "__len__") and hasattr(ds, "__getitem__")):
        raise SpecError(f"{field}: must return a map-style torch.utils.data.Dataset (with __len__ and "
                        f"__getitem__), got {type(ds).__name__}")
    if len(ds) < 1:
        raise SpecError(f"{field}: the dataset is empty")
    return ds  # type: ignore[no-any-return]


def split_held_out(ds: Dataset[Any], fraction: float, seed: int) -> tuple[Dataset[Any], Dataset[Any] | None]:
    """(train, eval): a seeded random ``fraction`` of the items held out (at least one when ``fraction > 0``)."""
    n = len(ds)  # type: ignore[arg-type]
    k = min(n - 1, max(1, round(n * fraction))) if fraction > 0 and n > 1 else 0
    if k == 0:
        return ds, None
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(stream_seed("held-out", seed)))
    return Subset(ds, sorted(perm[k:].tolist())), Subset(ds, sorted(perm[:k].tolist()))


def _collate(items: list[Any], field: str) -> Batch:
    first = items[0]
    if isinstance(first, dict):
        return dict(default_collate(items))
    if isinstance(first, tuple | list) and len(first) == 2:
        inputs, targets = default_collate(items)
        return inputs, targets
    desc = f"a {len(first)}-tuple" if isinstance(first, tuple | list) else type(first).__name__
    raise SpecError(f"{field}: dataset items must be (inputs, targets) pairs or dicts of tensors, got {desc}")


TARGET_VALUES_LIMIT = 1 << 24
"""A TensorDataset whose training targets hold more values than this (16M: 128 MB as int64 or float64) has its
trivial loss measured on a seeded sample of rows that hold about this many: the measurement copies what it reads."""


def trivial_loss_rows(n: int, keep: int, seed: int) -> list[int]:
    """A seeded sample of ``keep`` of ``range(n)``, sorted: the rows the trivial loss is measured on when there are
    too many to read, the same on every rank."""
    return sorted(random.Random(stream_seed("trivial-loss", seed)).sample(range(n), keep))


def _target_of(item: Any) -> Any:
    """An item's targets: the second of an ``(inputs, targets)`` pair, a dict item's ``labels`` (None: neither)."""
    if isinstance(item, dict):
        return item.get("labels")
    return item[1] if isinstance(item, tuple | list) and len(item) == 2 else None


def fetch(ds: Dataset[Any], indices: Sequence[int], field: str) -> Batch:
    """The collated batch of ``ds[i] for i in indices`` (a TensorDataset, possibly under Subsets, is sliced at once:
    the same tensors ``default_collate`` would stack)."""
    base, idx = ds, list(indices)
    while isinstance(base, Subset):
        idx = [int(base.indices[i]) for i in idx]
        base = base.dataset
    try:
        if isinstance(base, TensorDataset) and len(base.tensors) == 2:
            rows = torch.tensor(idx, dtype=torch.long)
            return base.tensors[0][rows], base.tensors[1][rows]
        getitems = getattr(base, "__getitems__", None)
        items = getitems(idx) if callable(getitems) else [base[i] for i in idx]
    except SpecError:
        raise
    except Exception as exc:
        raise SpecError(f"{field}: reading dataset items raised {type(exc).__name__}: {exc}") from exc
    return _collate(list(items), field)


class DatasetSource(DataSource):
    """A map-style Dataset behind the ``DataSource`` contract (see the module docstring).

    Dimensions come from training batch 0: tuple batches like ``custom`` data (integer inputs → tokens, 2-D float
    → features, 3-D float → sequence), so built-in models can train on a Dataset too; dict batches with
    ``input_ids`` are tokens. No loss floor is known; the trivial loss is measured on the training targets
    (``training_targets``) by the trainer, under the run's loss.
    """

    field = "data.factory"

    def __init__(
        self,
        spec: Any,
        *,
        seed: int,
        batch_size: int,
        rank: int,
        world_size: int,
        allowed_import_modules: Sequence[str] = (),
        datasets: tuple[Dataset[Any], Dataset[Any] | None] | None = None,
    ) -> None:
        super().__init__(spec, seed=seed, batch_size=batch_size, rank=rank, world_size=world_size)
        train, held_out = datasets if datasets is not None else self._load(spec, allowed_import_modules)
        self.train_set, self.eval_set = train, held_out
        shuffle = bool(getattr(spec, "shuffle", True))
        kw: dict[str, Any] = {"seed": seed, "rank": rank, "world_size": world_size, "batch_size": batch_size,
                              "shuffle": shuffle}
        self.sampler = SeededSampler(len(train), stream="train", **kw)  # type: ignore[arg-type]
        self.eval_sampler = None if held_out is None else SeededSampler(len(held_out), stream="eval", **kw)  # type: ignore[arg-type]
        self._infer_dims(self.batch(0))

    def _load(self, spec: DatasetData, allowed: Sequence[str]) -> tuple[Dataset[Any], Dataset[Any] | None]:
        train = self._call(spec.factory, spec.params, allowed, "data.factory")
        if spec.eval_factory is not None:
            return train, self._call(spec.eval_factory, spec.params, allowed, "data.eval_factory")
        return split_held_out(train, spec.eval_fraction, stream_seed(self._key, self.seed))

    @staticmethod
    def _call(ref: str, params: dict[str, Any], allowed: Sequence[str], field: str) -> Dataset[Any]:
        factory = resolve_import(ref, allowed, field=field)
        try:
            ds = factory(**params)
        except Exception as exc:
            raise SpecError(f"{field}: {ref} raised {type(exc).__name__}: {exc}") from exc
        return _check_dataset(ds, field)

    def _infer_dims(self, batch: Batch) -> None:
        self.kind: DataKind
        if isinstance(batch, dict):
            ids = batch.get("input_ids")
            self.kind = "tokens" if ids is not None else "features"
            if ids is not None and ids.ndim >= 2:
                self.seq_len = int(ids.shape[1])
            return
        inputs, targets = batch
        if not inputs.is_floating_point():
            self.kind = "tokens"
            self.seq_len = int(inputs.shape[1]) if inputs.ndim >= 2 else None
            return
        self.kind = "sequence" if inputs.ndim == 3 else "features"
        if inputs.ndim in (2, 3):
            self.input_dim = int(inputs.shape[-1])
            self.output_dim = int(targets.shape[-1]) if targets.ndim == inputs.ndim else 1
            self.seq_len = int(inputs.shape[1]) if inputs.ndim == 3 else None

    def training_targets(self) -> Tensor | None:
        """The training split's targets (``labels`` of dict items), the same on every rank: a TensorDataset's at once
        (a seeded sample of its rows past ``TARGET_VALUES_LIMIT`` values); any other dataset's read item by item,
        all of them or a seeded sample of ``TARGETS_READ_LIMIT`` items (None when an item has no targets)."""
        n = len(self.train_set)  # type: ignore[arg-type]
        base, rows = self.train_set, torch.arange(n)
        while isinstance(base, Subset):  # the split's rows of the dataset underneath, without a Python loop
            rows = torch.as_tensor(base.indices, dtype=torch.long)[rows]
            base = base.dataset
        if isinstance(base, TensorDataset) and len(base.tensors) == 2:
            column = base.tensors[1]
            per_row = max(1, column[0].numel()) if len(column) else 1
            if n * per_row > TARGET_VALUES_LIMIT:  # the same sample on every rank
                keep = max(1, TARGET_VALUES_LIMIT // per_row)
                rows = rows[trivial_loss_rows(n, keep, self.seed)]
            return column[rows]
        picks = range(n) if n <= TARGETS_READ_LIMIT else trivial_loss_rows(n, TARGETS_READ_LIMIT, self.seed)
        try:  # a check on top of the run's own: an item that fails to read leaves it unknown, the attempt goes on
            targets = [_target_of(self.train_set[i]) for i in picks]
            if any(t is None for t in targets):
                return None
            stacked = default_collate(targets)
        except Exception:  # noqa: BLE001 - see above
            return None
        return stacked if isinstance(stacked, Tensor) else None

    def batch(self, index: int) -> Batch:
        """Training batch ``index`` of this rank (see ``SeededSampler``)."""
        return fetch(self.train_set, self.sampler.indices(index), self.field)

    def eval_batch(self, index: int) -> Batch:
        """Held-out batch ``index`` of this rank, from items training never sees."""
        if self.eval_set is None or self.eval_sampler is None:
            raise SpecError("data.eval_fraction: this data has no held-out items (set eval_fraction > 0 or "
                            "eval_factory)")
        return fetch(self.eval_set, self.eval_sampler.indices(index), self.field)

    def _make(self, gen: torch.Generator, index: int, stream: str) -> Batch:  # pragma: no cover - unused
        raise NotImplementedError
