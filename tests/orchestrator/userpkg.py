"""A user's own package, written into a directory of the test's choosing (never on the test process's
``sys.path`` unless a test puts it there): the model and data factories of the setup-error and user-code tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

PACKAGE = "ballast_userpkg"

_MODELS = '''
import torch
import torch.nn.functional as F
from torch import nn


class Tiny(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(dim, hidden), nn.Linear(hidden, 1)])

    def forward(self, batch):
        x, y = batch
        return F.mse_loss(self.blocks[1](torch.tanh(self.blocks[0](x))), y)


class PerSample(Tiny):
    def forward(self, batch):
        x, y = batch
        return (self.blocks[1](torch.tanh(self.blocks[0](x))) - y).pow(2).flatten()


def make_model(dim=3, hidden=8):
    return Tiny(dim, hidden)


def make_not_a_module():
    return {"a": 1}


def make_per_sample_loss(dim=3, hidden=8):
    return PerSample(dim, hidden)


def make_batch(index, batch_size, seed, dim=3):
    g = torch.Generator().manual_seed(seed + 7919 * index)
    x = torch.randn(batch_size, dim, generator=g)
    return x, x.sum(1, keepdim=True)
'''


def write_package(root: Path) -> Path:
    """``root/ballast_userpkg/{__init__,models}.py``; returns the package directory."""
    pkg = root / PACKAGE
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "models.py").write_text(_MODELS)
    return pkg


def custom_sections(model_factory: str = "make_model") -> dict[str, Any]:
    """The ``model`` and ``data`` sections of a recipe that trains the package's model on its data."""
    return {
        "model": {"name": "custom", "factory": f"{PACKAGE}.models:{model_factory}"},
        "data": {"name": "custom", "factory": f"{PACKAGE}.models:make_batch"},
    }
