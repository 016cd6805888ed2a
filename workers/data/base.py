"""What every data source shares: the ``DataSource`` contract, seeding, the import rule, ``SpecError``.

A source is addressable by batch index: ``batch(index)`` is a pure function of (spec, training seed, rank, world
size, index), with no iterator state, so a resumed attempt, a rollback or a skipped data window replays exactly by
asking for the same indices again, and different ranks draw different batches.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from contracts.recipe import RegressionData
from workers.data.batch import Batch

DataKind = Literal["tokens", "features", "sequence"]

_IMPORT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")



class SpecError(ValueError):
    """A model or data spec that cannot be built; the message starts with the offending field's path."""


class DataDims(Protocol):
    """What a model needs to know about its data (``build_model`` reads only these)."""

    @property
    def kind(self) -> DataKind: ...

    @property
    def input_dim(self) -> int | None: ...

    @property
    def output_dim(self) -> int | None: ...

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def seq_len(self) -> int | None: ...


# --------------------------------------------------------------------------------------------- import policy
def module_allowed(module: str, allowed_import_modules: Sequence[str]) -> bool:
    """The recipe's rule: the module equals an allowed prefix or lies below it (``a`` allows ``a.b``)."""
    return any(module == a or module.startswith(a + ".") for a in allowed_import_modules)


def resolve_import(ref: str, allowed_import_modules: Sequence[str], *, field: str) -> Callable[..., Any]:
    """Import ``module:function`` after re-checking the allow-list (never trust that validation ran earlier).

    The allow-list is checked *before* importing, because importing a module runs its code.
    """
    if not _IMPORT_RE.match(ref):
        raise SpecError(f"{field}: {ref!r} is not a 'module:function' import string")
    module_name, func_name = ref.split(":", 1)
    allowed = list(allowed_import_modules)
    if not module_allowed(module_name, allowed):
        raise SpecError(
            f"{field}: module {module_name!r} is not on the operator's allow-list "
            f"(BALLAST_ALLOWED_IMPORT_MODULES: {allowed})"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure inside user code becomes a clear spec error
        raise SpecError(f"{field}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    func = getattr(module, func_name, None)
    if func is None:
        raise SpecError(f"{field}: module {module_name!r} has no attribute {func_name!r}")
    if not callable(func):
        raise SpecError(f"{field}: {ref!r} is not callable")
    return func  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------------ seeding
def stream_seed(*parts: object) -> int:
    """A 63-bit seed from a hash of ``parts`` (stable across processes, unlike ``hash()``)."""
    text = "|".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


# Fields added to a data section after its batches were first defined: left out of the stream key while they
# hold their default, so every batch of a recipe that does not use them stays bit-identical.
_KEY_NEUTRAL_DEFAULTS: dict[type, dict[str, Any]] = {RegressionData: {"fixed_design": False, "num_samples": 256}}


def _spec_key(spec: Any) -> str:
    dumped = spec.model_dump(mode="json")
    for name, default in _KEY_NEUTRAL_DEFAULTS.get(type(spec), {}).items():
        if dumped.get(name) == default:
            dumped.pop(name, None)
    return json.dumps(dumped, sort_keys=True, separators=(",", ":"))


TARGETS_READ_LIMIT = 4096
"""The trivial loss of data whose targets are read item by item or batch by batch (an item may be an image to
decode, a batch a file to read) is measured on at most this many items: all of them, or a seeded sample, once per
attempt (``DataSource.training_targets``)."""


# ---------------------------------------------------------------------------------------------- the source
class DataSource(ABC):
    """One rank's view of a data set: ``batch(index)`` for training, ``eval_batch(index)`` held out.

    ``index`` is a micro-batch counter chosen by the engine (it must be a pure function of the step, e.g.
    ``(step + data_offset) * grad_accum_steps + micro``); the same index always gives the same batch.
    """

    kind: DataKind
    input_dim: int | None = None
    """Feature size per sample (features) or per position (sequence); None for tokens."""
    output_dim: int | None = None
    """Target size per sample/position; None for tokens."""
    vocab_size: int | None = None
    """Token vocabulary (tokens only)."""
    seq_len: int | None = None
    """Positions per sample (tokens, sequence)."""
    entropy_floor: float | None = None
    """Markov data: the exact conditional entropy of the source (nats/token), the lowest achievable CE."""
    loss_floor: float | None = None
    """The lowest achievable loss of a perfect model in the model's loss units (CE or MSE), when known."""
    trivial_loss: float | None = None
    """The training loss of the best prediction that ignores the inputs (the targets' mean for MSE, their
    frequencies for CE), when known: a model that ends no lower has learned nothing from its inputs, however far
    it fell from a blown-up initial loss (``workers/verdict.py``)."""

    def __init__(self, spec: Any, *, seed: int, batch_size: int, rank: int, world_size: int) -> None:
        if batch_size < 1:
            raise SpecError(f"training.batch_size: must be >= 1, got {batch_size}")
        if world_size < 1:
            raise SpecError(f"resources.num_workers: world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise SpecError(f"rank {rank} is outside [0, world_size={world_size})")
        self.spec = spec
        self.seed = seed
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self._key = _spec_key(spec)

    def training_targets(self) -> Tensor | None:
        """The training targets, or a fair sample of them, the same on every rank: the trainer measures the trivial
        loss on them when the source does not know it. None here (synthetic data knows its trivial loss)."""
        return None

    def _generator(self, stream: str, index: int) -> torch.Generator:
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        return torch.Generator().manual_seed(stream_seed(self._key, self.seed, self.rank, stream, index))

    def batch(self, index: int) -> Batch:
        """Training batch ``index`` of this rank: ``(inputs, targets)`` or a dict of tensors."""
        return self._make(self._generator("train", index), index, "train")

    def eval_batch(self, index: int) -> Batch:
        """Held-out batch ``index`` of this rank, from a seed space disjoint from training batches."""
        return self._make(self._generator("eval", index), index, "eval")

    @property
    def tokens_per_batch(self) -> int | None:
        """Predicted tokens per batch (tokens data), for tokens/s telemetry."""
        if self.kind == "tokens" and self.seq_len is not None:
            return self.batch_size * self.seq_len
        return None

    @abstractmethod
    def _make(self, gen: torch.Generator, index: int, stream: str) -> Batch: ...
