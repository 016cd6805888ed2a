"""The seeded, resumable sampler behind Dataset-backed sources.

Rank ``r`` of ``W`` takes, for batch ``index``, the global sample positions ``(index·W + r)·B … + B - 1``. Position
``p`` falls in epoch ``p // N`` (N items) and picks item ``perm(seed, epoch)[p % N]``, a fresh seeded permutation per
epoch. So every batch is a pure function of (seed, rank, world size, index): a resume, a rollback or a skipped data
window replays exactly, ranks never share an item within an epoch, and no iterator state exists to save.
"""

from __future__ import annotations

import torch
from torch import Tensor

from workers.data.base import stream_seed


class SeededSampler:
    """``indices(index)``: the dataset items of batch ``index`` for one rank (see the module docstring)."""

    def __init__(self, n: int, *, seed: int, rank: int, world_size: int, batch_size: int, shuffle: bool = True,
                 stream: str = "train") -> None:
        if n < 1:
            raise ValueError("the dataset is empty")
        self.n, self.seed, self.rank, self.world_size, self.batch_size = n, seed, rank, world_size, batch_size
        self.shuffle, self.stream = shuffle, stream
        self._perms: dict[int, Tensor] = {}

    def epoch_of(self, index: int) -> int:
        """The epoch batch ``index`` starts in."""
        return ((index * self.world_size + self.rank) * self.batch_size) // self.n

    def permutation(self, epoch: int) -> Tensor:
        """Item order of ``epoch`` (the identity without shuffling); the two most recent are cached."""
        perm = self._perms.get(epoch)
        if perm is None:
            if self.shuffle:
                gen = torch.Generator().manual_seed(stream_seed("sampler", self.stream, self.seed, epoch))
                perm = torch.randperm(self.n, generator=gen)
            else:
                perm = torch.arange(self.n)
            if len(self._perms) >= 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = perm
        return perm

    def indices(self, index: int) -> list[int]:
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        start = (index * self.world_size + self.rank) * self.batch_size
        out: list[int] = []
        for pos in range(start, start + self.batch_size):
            epoch, offset = divmod(pos, self.n)
            out.append(int(self.permutation(epoch)[offset]))
        return out
