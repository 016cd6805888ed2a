"""A stand-in for a Hugging Face model (no transformers needed): a custom Ballast model with tied input and output
embeddings and a ``save_pretrained`` that writes a config and safetensors weights, as ``PreTrainedModel`` does."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_model
from torch import Tensor, nn


class HFLike(nn.Module):
    def __init__(self, vocab_size: int, d_model: int) -> None:
        super().__init__()
        self.config = {"model_type": "hf-like", "vocab_size": vocab_size, "d_model": d_model}
        self.embed = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList([nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)])
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight  # tie_word_embeddings

    def forward(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        inputs, targets = batch
        x = self.embed(inputs)
        for block in self.blocks:
            x = x + torch.tanh(block(x))
        logits = self.lm_head(x).float()
        return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    def save_pretrained(self, directory: str) -> None:
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(self.config))
        save_model(self, str(out / "model.safetensors"))


def build(vocab_size: int = 64, d_model: int = 16) -> HFLike:
    return HFLike(vocab_size, d_model)
