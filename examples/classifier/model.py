"""An ordinary PyTorch classifier and its data, exactly as you would write them without Ballast.

Nothing here knows about Ballast: ``forward(x) -> logits``, no loss inside, no ``blocks`` attribute (Ballast finds
the ``layers`` ModuleList itself), and a plain ``TensorDataset``. The recipe (``recipe.yaml``) names the two
factories and adds ``loss: {name: cross_entropy, label_smoothing: 0.1}``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.data import TensorDataset


class Classifier(nn.Module):
    """An MLP: stem → ``depth`` residual LayerNorm blocks → head (logits over ``classes``)."""

    def __init__(self, in_features: int = 16, hidden: int = 64, classes: int = 4, depth: int = 3) -> None:
        super().__init__()
        self.stem = nn.Linear(in_features, hidden)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, hidden), nn.GELU()) for _ in range(depth)
        )
        self.head = nn.Linear(hidden, classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.stem(x)
        for layer in self.layers:
            h = h + layer(h)
        out: Tensor = self.head(h)
        return out


def make_classifier(in_features: int = 16, hidden: int = 64, classes: int = 4, depth: int = 3) -> nn.Module:
    return Classifier(in_features, hidden, classes, depth)


def make_dataset(n: int = 2048, in_features: int = 16, classes: int = 4, seed: int = 0) -> TensorDataset:
    """Gaussian blobs: ``classes`` random centres, unit noise; labels are the blob each point came from."""
    g = torch.Generator().manual_seed(seed)
    centres = 2.0 * torch.randn(classes, in_features, generator=g)
    labels = torch.randint(classes, (n,), generator=g)
    x = centres[labels] + torch.randn(n, in_features, generator=g)
    return TensorDataset(x, labels)
