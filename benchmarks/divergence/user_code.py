"""Models and datasets written as a user writes them, for the fresh scenarios on your own code (``fresh.py``,
``--set 2026-12-07c``): plain ``nn.Module`` classes with no Ballast attributes, ``TensorDataset`` and dict-item
``Dataset`` factories, each seeded. Recipes name them by import string (``benchmarks.divergence.user_code:...``)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset


def offset_regression(n: int = 2048, dim: int = 16, offset: float = 3.0, noise: float = 0.1,
                      seed: int = 0) -> TensorDataset:
    """Targets ``offset + x @ w + noise`` (``w ~ N(0, 1/dim)``): a mean far from 0, a variance of ~1."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = offset + x @ (torch.randn(dim, 1, generator=g) / dim**0.5) + noise * torch.randn(n, 1, generator=g)
    return TensorDataset(x, y)


def imbalanced_classes(n: int = 4096, dim: int = 16, classes: int = 4, major: float = 0.9,
                       seed: int = 0) -> TensorDataset:
    """Labels from a random linear map of the features, then about ``major`` of those with ``x[0] > -0.5``
    relabelled 0: learnable, and most of them one class."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, dim, generator=g)
    y = (x @ torch.randn(dim, classes, generator=g)).argmax(-1)
    y = torch.where((torch.rand(n, generator=g) < major) & (x[:, 0] > -0.5), torch.zeros_like(y), y)
    return TensorDataset(x, y)


def unrelated_labels(n: int = 4096, dim: int = 8, major: float = 0.9, seed: int = 0) -> TensorDataset:
    """Two classes drawn independently of the features, ``major`` of them class 0: nothing to learn."""
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, dim, generator=g), (torch.rand(n, generator=g) > major).long())


class Keyed(Dataset[dict[str, Tensor]]):
    """Dict items ``{"features", "labels"}``: the label is which of three feature groups has the largest sum."""

    def __init__(self, n: int = 3072, dim: int = 12, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=g)
        self.y = self.x.reshape(n, 3, dim // 3).sum(-1).argmax(-1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"features": self.x[i], "labels": self.y[i]}


def keyed(n: int = 3072, dim: int = 12, seed: int = 0) -> Keyed:
    return Keyed(n, dim, seed)


class MLP(nn.Module):
    def __init__(self, in_features: int = 16, hidden: int = 64, out: int = 1, depth: int = 3) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(in_features, hidden), nn.ReLU()]
        for _ in range(depth - 1):
            layers += [nn.Linear(hidden, hidden), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(hidden, out)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.body(x))
        return out


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.ff = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = x + self.ff(self.norm(x))
        return out


class ResidualMLP(nn.Module):
    """Pre-LayerNorm residual blocks in ``layers`` (a ModuleList: Ballast finds them as the blocks)."""

    def __init__(self, in_features: int = 16, width: int = 64, out: int = 1, depth: int = 4) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, width)
        self.layers = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, out))

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for block in self.layers:
            h = block(h)
        out: Tensor = self.head(h)
        return out


class KeyedNet(nn.Module):
    """Called as ``model(**batch)``: ``forward(features, labels=None) -> logits``."""

    def __init__(self, dim: int = 12, hidden: int = 48, classes: int = 3) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                 nn.Linear(hidden, classes))

    def forward(self, features: Tensor, labels: Tensor | None = None) -> Tensor:
        out: Tensor = self.net(features)
        return out


def mlp(**params: int) -> MLP:
    return MLP(**params)


def residual_mlp(**params: int) -> ResidualMLP:
    return ResidualMLP(**params)


def keyed_net(**params: int) -> KeyedNet:
    return KeyedNet(**params)
