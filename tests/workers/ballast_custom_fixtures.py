"""Factories that the custom-model/data tests name by import string (module `ballast_custom_fixtures`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class TinyCustom(nn.Module):
    """Honours the model contract: forward((x, y)) -> scalar MSE, blocks in input → output order."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(dim, hidden), nn.Linear(hidden, 1)])

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        pred: Tensor = self.blocks[1](torch.tanh(self.blocks[0](x)))
        return F.mse_loss(pred, y)


class VectorLoss(TinyCustom):
    """Breaks the contract: returns per-sample losses instead of their mean."""

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        pred: Tensor = self.blocks[1](torch.tanh(self.blocks[0](x)))
        return (pred - y).pow(2).flatten()


def make_model(dim: int = 3, hidden: int = 8) -> nn.Module:
    return TinyCustom(dim, hidden)


def make_vector_loss_model(dim: int = 3, hidden: int = 8) -> nn.Module:
    return VectorLoss(dim, hidden)


def make_blockless_model() -> nn.Module:
    return nn.Linear(3, 1)


class BadBlocks(TinyCustom):
    """Breaks the blocks contract: ``blocks`` names a module that is not part of the model."""

    def __init__(self) -> None:
        super().__init__(3, 8)
        layers = self.blocks
        del self.blocks
        self.layers = layers
        self.blocks = [layers[0], nn.Linear(8, 1)]  # a plain list: not registered

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        x, y = batch
        return F.mse_loss(self.layers[1](torch.tanh(self.layers[0](x))), y)


def make_bad_blocks_model() -> nn.Module:
    return BadBlocks()


def make_not_a_module() -> dict[str, int]:
    return {"a": 1}


def make_batch(index: int, batch_size: int, seed: int, dim: int = 3) -> tuple[Tensor, Tensor]:
    """Custom data: seeded by the seed Ballast passes in, so batches are deterministic per (seed, index)."""
    g = torch.Generator().manual_seed(seed + 7919 * index)
    x = torch.randn(batch_size, dim, generator=g)
    return x, x.sum(1, keepdim=True)


def make_two_batches(index: int, batch_size: int, seed: int) -> tuple[Tensor, Tensor]:
    """Custom data with only two batches: a run of two steps never asks for a third."""
    if index >= 2:
        raise IndexError(f"no batch {index}")
    return make_batch(index, batch_size, seed)


def make_bad_batch(index: int, batch_size: int, seed: int) -> Tensor:
    """Breaks the data contract: one tensor instead of (inputs, targets)."""
    return torch.zeros(batch_size, 3)


# ------------------------------------------------------------------------ plain models, datasets and losses
class DictFeatures(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Dict items: {"x": float features, "labels": class index}."""

    def __init__(self, n: int = 64, dim: int = 3) -> None:
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (self.x.sum(1) > 0).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


class KeywordClassifier(nn.Module):
    """forward(x, labels=None) -> logits: called as model(**batch) with a dict batch."""

    def __init__(self, dim: int = 3) -> None:
        super().__init__()
        self.net = nn.Linear(dim, 2)

    def forward(self, x: Tensor, labels: Tensor | None = None) -> Tensor:
        out: Tensor = self.net(x)
        return out


def make_dict_dataset(n: int = 64, dim: int = 3) -> DictFeatures:
    return DictFeatures(n, dim)


def make_keyword_classifier(dim: int = 3) -> nn.Module:
    return KeywordClassifier(dim)


def make_triples(n: int = 16) -> torch.utils.data.TensorDataset:
    """Breaks the dataset contract: items are 3-tuples."""
    return torch.utils.data.TensorDataset(torch.zeros(n, 3), torch.zeros(n, 1), torch.zeros(n, 1))


def make_regression_dataset(n: int = 128, dim: int = 3) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(11)
    x = torch.randn(n, dim, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True))


def make_mlp(dim: int = 3) -> nn.Module:
    """A plain nn.Sequential regression model: forward(x) -> predictions (no ModuleList: no blocks found)."""
    return nn.Sequential(nn.Linear(dim, 8), nn.Tanh(), nn.Linear(8, 1))


def l1_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    return (outputs - targets).abs().mean()


def per_sample_loss(outputs: Tensor, targets: Tensor) -> Tensor:
    """Breaks the loss contract: not a scalar."""
    return (outputs - targets).abs()


def make_linear_targets(n: int = 2048, dim: int = 16) -> torch.utils.data.TensorDataset:
    """Regression targets ``x @ w`` of about unit variance (``w ~ N(0, 1/dim)``): predicting their mean scores ~1."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(n, dim, generator=g)
    return torch.utils.data.TensorDataset(x, x @ (torch.randn(dim, 1, generator=g) / dim**0.5))


def make_unrelated_labels(n: int = 4096, dim: int = 8, major: float = 0.9) -> torch.utils.data.TensorDataset:
    """Two classes drawn independently of the features, ``major`` of them class 0: there is nothing to learn from
    the inputs, and the best any model can do is the labels' frequencies."""
    g = torch.Generator().manual_seed(17)
    return torch.utils.data.TensorDataset(torch.randn(n, dim, generator=g),
                                          (torch.rand(n, generator=g) > major).long())


def make_noisy_labels(n: int = 8192, dim: int = 16) -> torch.utils.data.TensorDataset:
    """Two classes drawn as ``Bernoulli(sigmoid(x @ w))`` with a weak ``w``: learnable, but the best possible
    cross-entropy is not far below a coin toss's (a hard task: churn, clicks)."""
    g = torch.Generator().manual_seed(19)
    x = torch.randn(n, dim, generator=g)
    p = torch.sigmoid(x @ (torch.randn(dim, generator=g) / dim**0.5))
    return torch.utils.data.TensorDataset(x, (torch.rand(n, generator=g) < p).long())


class UnrelatedPairs(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """``(features, label)`` items read one by one (not a TensorDataset), the labels drawn independently of the
    features, ``major`` of them class 0: more items than the trivial loss reads, so it reads a sample."""

    def __init__(self, n: int, dim: int, major: float) -> None:
        g = torch.Generator().manual_seed(23)
        self.x = torch.randn(n, dim, generator=g)
        self.y = (torch.rand(n, generator=g) > major).long()

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        return self.x[i], self.y[i]


def make_unrelated_pairs(n: int = 6000, dim: int = 8, major: float = 0.9) -> UnrelatedPairs:
    return UnrelatedPairs(n, dim, major)


def make_unrelated_batch(index: int, batch_size: int, seed: int, dim: int = 8,
                         major: float = 0.9) -> tuple[Tensor, Tensor]:
    """Custom data like ``make_unrelated_labels``: labels drawn independently of the features, per batch."""
    g = torch.Generator().manual_seed(seed + 7919 * index)
    return torch.randn(batch_size, dim, generator=g), (torch.rand(batch_size, generator=g) > major).long()
