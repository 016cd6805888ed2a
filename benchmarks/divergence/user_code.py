"""Models and data written as a user writes them, for the fresh scenarios on your own code (``fresh.py``, ``--set
2026-12-07c``, ``2026-12-07d``, ``2026-12-07e``): plain ``nn.Module`` classes with no Ballast attributes,
``TensorDataset``, dict-item and lazily made ``Dataset`` factories and ``custom`` batch factories, each seeded.
Recipes name them by import string (``benchmarks.divergence.user_code:...``)."""

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


# ---------------------------------------------------------------------------------------------------------------
# the thirteenth set (``--set 2026-12-07d``): data read batch by batch (``custom`` factories), large lazy datasets,
# sequences and images


def _batch_generator(index: int, seed: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed + 1_000_003 * index) % (1 << 63))


def running_mean_batch(index: int, batch_size: int, seed: int, seq_len: int = 20,
                       dim: int = 4) -> tuple[Tensor, Tensor]:
    """Custom data: sequences ``(B, T, dim)`` whose target at each position is the running mean of the first
    feature so far, plus a little noise (an RNN must carry state to predict it)."""
    g = _batch_generator(index, seed)
    x = torch.randn(batch_size, seq_len, dim, generator=g)
    steps = torch.arange(1, seq_len + 1, dtype=x.dtype).view(1, seq_len)
    y = (x[..., 0].cumsum(1) / steps).unsqueeze(-1) + 0.05 * torch.randn(batch_size, seq_len, 1, generator=g)
    return x, y


def smooth_regression_batch(index: int, batch_size: int, seed: int, dim: int = 8) -> tuple[Tensor, Tensor]:
    """Custom data: ``sin(x @ a) + 0.5 * (x @ b)**2`` per sample, a fixed ``a``/``b`` (seed 0), fresh ``x``."""
    fixed = torch.Generator().manual_seed(0)
    a, b = torch.randn(dim, 1, generator=fixed) / dim**0.5, torch.randn(dim, 1, generator=fixed) / dim**0.5
    x = torch.randn(batch_size, dim, generator=_batch_generator(index, seed))
    return x, torch.sin(x @ a) + 0.5 * (x @ b) ** 2


def coin_batch(index: int, batch_size: int, seed: int, dim: int = 8, major: float = 0.8) -> tuple[Tensor, Tensor]:
    """Custom data with nothing to learn: labels drawn independently of the features, ``major`` of them class 0."""
    g = _batch_generator(index, seed)
    return torch.randn(batch_size, dim, generator=g), (torch.rand(batch_size, generator=g) > major).long()


class LazyPairs(Dataset[tuple[Tensor, Tensor]]):
    """A large map-style dataset whose items are made when read (as a dataset reading files is): item ``i`` is a
    feature vector seeded by ``i`` and a label from a fixed random linear map of it (``related``) or drawn apart
    from it (not)."""

    def __init__(self, n: int, dim: int, classes: int, related: bool, seed: int) -> None:
        self.n, self.dim, self.classes, self.related, self.seed = n, dim, classes, related, seed
        self.w = torch.randn(dim, classes, generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        x = torch.randn(self.dim, generator=g)
        y = (x @ self.w).argmax() if self.related else torch.randint(self.classes, (), generator=g)
        return x, y


def lazy_pairs(n: int = 20_000, dim: int = 16, classes: int = 5, related: bool = True, seed: int = 0) -> LazyPairs:
    return LazyPairs(n, dim, classes, related, seed)


def blob_images(n: int = 3000, size: int = 12, seed: int = 0) -> TensorDataset:
    """``(1, size, size)`` images of one Gaussian blob on noise; the label is the blob's quadrant (4 classes)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(n, 2, generator=g) * (size - 1)
    grid = torch.arange(size, dtype=torch.float32)
    dy = (grid.view(1, size, 1) - centres[:, 0].view(n, 1, 1)) ** 2
    dx = (grid.view(1, 1, size) - centres[:, 1].view(n, 1, 1)) ** 2
    images = torch.exp(-(dx + dy) / 4.0) + 0.3 * torch.randn(n, size, size, generator=g)
    labels = (centres[:, 0] >= size / 2).long() * 2 + (centres[:, 1] >= size / 2).long()
    return TensorDataset(images.unsqueeze(1), labels)


class SeqLSTM(nn.Module):
    """An LSTM over ``(B, T, dim)`` with a linear read-out per position."""

    def __init__(self, dim: int = 4, hidden: int = 32) -> None:
        super().__init__()
        self.lstm = nn.LSTM(dim, hidden, batch_first=True)
        self.out = nn.Linear(hidden, 1)

    def forward(self, x: Tensor) -> Tensor:
        h, _ = self.lstm(x)
        out: Tensor = self.out(h)
        return out


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 4, width: int = 16) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(width, 2 * width, 3, padding=1), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(2 * width, classes)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.head(self.features(x).flatten(1))
        return out


def seq_lstm(**params: int) -> SeqLSTM:
    return SeqLSTM(**params)


def small_cnn(**params: int) -> SmallCNN:
    return SmallCNN(**params)
