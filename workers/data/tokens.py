"""Language-model data from a local file: ``data: {name: tokens_file, path, seq_len, tokenizer_path?}``.

The file is a token array (``.npy``, a ``.pt`` tensor, or a raw ``.bin`` of uint16/int32, memory-mapped where it
can be) or, with ``tokenizer_path``, text tokenized once by ``AutoTokenizer.from_pretrained(tokenizer_path,
local_files_only=True)``. It is cut into windows of ``seq_len`` tokens; the last ``eval_fraction`` of them are the
held-out set. Batches are dicts ``{input_ids, attention_mask, labels}`` (int64, labels = input_ids: a Hugging Face
causal LM shifts them itself) from the same seeded sampler as ``dataset`` data.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from contracts.recipe import TokensFileData
from workers.data.base import SpecError
from workers.data.dataset import DatasetSource


class TokenWindows(Dataset[dict[str, Tensor]]):
    """Windows ``[start + i·seq_len, start + (i+1)·seq_len)`` of a token array, ``count`` of them."""

    def __init__(self, tokens: Any, seq_len: int, first: int, count: int) -> None:
        self.tokens, self.seq_len, self.first, self.count = tokens, seq_len, first, count

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        if not 0 <= i < self.count:
            raise IndexError(i)
        lo = (self.first + i) * self.seq_len
        ids = torch.as_tensor(np.asarray(self.tokens[lo:lo + self.seq_len], dtype=np.int64))
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def load_tokens(spec: TokensFileData) -> tuple[Any, int | None]:
    """(a 1-D token array, the tokenizer's vocabulary size or None)."""
    path = Path(spec.path)
    if not path.is_file():
        raise SpecError(f"data.path: no such file: {spec.path}")
    if spec.tokenizer_path is not None:
        from workers.models.hf import require_transformers

        transformers = require_transformers("data.tokenizer_path")
        try:
            tok = transformers.AutoTokenizer.from_pretrained(spec.tokenizer_path, local_files_only=True)
        except Exception as exc:
            raise SpecError(f"data.tokenizer_path: cannot load a tokenizer from {spec.tokenizer_path}: "
                            f"{type(exc).__name__}: {exc}") from exc
        ids = tok(path.read_text(encoding="utf-8"))["input_ids"]
        return np.asarray(ids, dtype=np.int64), len(tok)
    suffix = path.suffix.lower()
    try:
        if suffix == ".npy":
            arr: Any = np.load(path, mmap_mode="r", allow_pickle=False)
        elif suffix == ".bin":
            arr = np.memmap(path, dtype=np.dtype(spec.dtype.value), mode="r")
        elif suffix == ".pt":
            tensor = torch.load(path, weights_only=True, map_location="cpu")
            if not isinstance(tensor, Tensor):
                raise SpecError(f"data.path: {spec.path} holds a {type(tensor).__name__}, not a tensor of tokens")
            arr = tensor.reshape(-1).numpy()
        else:
            raise SpecError(f"data.path: {spec.path} is not a token file (.npy, .bin, .pt); a text file needs "
                            "data.tokenizer_path")
    except SpecError:
        raise
    except Exception as exc:
        raise SpecError(f"data.path: cannot read {spec.path}: {type(exc).__name__}: {exc}") from exc
    if arr.dtype.kind not in "iu":
        raise SpecError(f"data.path: tokens must be integers, got {arr.dtype}")
    return arr.reshape(-1), None


class TokensFileSource(DatasetSource):
    """``tokens_file`` data (see the module docstring); ``vocab_size`` is the tokenizer's, else max token + 1."""

    field = "data.path"

    def __init__(self, spec: TokensFileData, *, seed: int, batch_size: int, rank: int, world_size: int,
                 allowed_import_modules: Sequence[str] = ()) -> None:
        tokens, vocab = load_tokens(spec)
        n_windows = len(tokens) // spec.seq_len
        n_eval = min(n_windows - 1, max(1, round(n_windows * spec.eval_fraction))) if spec.eval_fraction > 0 else 0
        if n_windows - n_eval < 1 or (spec.eval_fraction > 0 and n_eval < 1):
            raise SpecError(f"data.path: {len(tokens)} tokens make {n_windows} windows of data.seq_len "
                            f"{spec.seq_len}; need at least {2 if spec.eval_fraction > 0 else 1}")
        if len(tokens) and int(np.min(tokens)) < 0:
            raise SpecError("data.path: token ids must be >= 0")
        self.token_count = len(tokens)
        train = TokenWindows(tokens, spec.seq_len, 0, n_windows - n_eval)
        held_out = TokenWindows(tokens, spec.seq_len, n_windows - n_eval, n_eval) if n_eval else None
        super().__init__(spec, seed=seed, batch_size=batch_size, rank=rank, world_size=world_size,
                         datasets=(train, held_out))
        self.kind = "tokens"
        self.seq_len = spec.seq_len
        self.vocab_size = vocab if vocab is not None else int(np.max(tokens)) + 1
