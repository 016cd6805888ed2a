"""The built-in models: tiny_gpt, deep_mlp, rnn, linear.

Each ``m(batch)`` with ``batch = (inputs, targets)`` returns the **scalar mean loss** (float32, 0-dim) and has
``m.blocks`` (an ``nn.ModuleList``) in input → output order, registered as ``blocks.{i}.*`` parameters;
``m.loss_spec()`` names that loss as a recipe's ``loss:`` section would.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from contracts.recipe import (
    Activation,
    CrossEntropyLoss,
    DeepMLPModel,
    LinearModel,
    LossSpec,
    MSELoss,
    NormPosition,
    RecurrentCell,
    RecurrentModel,
    TinyGPTModel,
)
from workers.models.blocks import set_activation_checkpointing

Batch = tuple[Tensor, Tensor]


class BallastModel(nn.Module):
    """Base of the built-in models: ``forward(batch) -> scalar loss`` and ``blocks`` in input → output order."""

    blocks: nn.ModuleList

    def loss_spec(self) -> LossSpec | None:
        """The loss ``forward`` returns, as a ``loss:`` section would name it (None: none of those): mean squared
        error for the regression models. The verdict's trivial loss on a user's dataset is measured under it."""
        return MSELoss()

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations in the backward pass (memory for compute; same gradients)."""
        set_activation_checkpointing(self, enabled)

    def _run_blocks(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


# -------------------------------------------------------------------------------------------------- tiny_gpt
class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int, qk_layernorm: bool) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.q_norm: nn.Module = nn.LayerNorm(self.head_dim) if qk_layernorm else nn.Identity()
        self.k_norm: nn.Module = nn.LayerNorm(self.head_dim) if qk_layernorm else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        bsz, length, width = x.shape
        q, k, v = self.qkv(x).view(bsz, length, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = self.q_norm(q), self.k_norm(k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.proj(y.transpose(1, 2).reshape(bsz, length, width))
        return out


class TransformerBlock(nn.Module):
    """Pre-LN: x + f(LN(x)) (stable). Post-LN: LN(x + f(x)) (the original; unstable without warmup)."""

    def __init__(self, spec: TinyGPTModel) -> None:
        super().__init__()
        d = spec.d_model
        self.pre_ln = spec.norm_position is NormPosition.pre
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, spec.n_heads, spec.qk_layernorm)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: Tensor) -> Tensor:
        if self.pre_ln:
            x = x + self.attn(self.ln1(x))
            out: Tensor = x + self.mlp(self.ln2(x))
        else:
            x = self.ln1(x + self.attn(x))
            out = self.ln2(x + self.mlp(x))
        return out


class TinyGPT(BallastModel):
    """A small causal transformer LM; loss = token CE + z_loss · mean(logsumexp(logits)²).

    All Linear and Embedding weights are N(0, init_std), biases zero, LayerNorms at identity. The loss is
    computed in float32 even under autocast. ``last_metrics`` holds the detached CE and z-loss terms of the
    latest forward (the CE is what compares with the data's entropy floor).
    """

    def __init__(self, spec: TinyGPTModel) -> None:
        super().__init__()
        self.spec = spec
        d = spec.d_model
        self.tok_emb = nn.Embedding(spec.vocab_size, d)
        self.pos_emb = nn.Embedding(spec.context, d)
        self.blocks = nn.ModuleList(TransformerBlock(spec) for _ in range(spec.n_layers))
        self.ln_f: nn.Module = nn.LayerNorm(d) if spec.norm_position is NormPosition.pre else nn.Identity()
        self.head = nn.Linear(d, spec.vocab_size, bias=False)
        self.z_loss = spec.z_loss
        self.last_metrics: dict[str, Tensor] = {}
        for module in self.modules():
            if isinstance(module, nn.Linear | nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=spec.init_std)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)

    def loss_spec(self) -> LossSpec | None:
        return CrossEntropyLoss() if self.z_loss == 0 else None  # with a z-loss term it is not CE alone

    def forward(self, batch: Batch) -> Tensor:
        inputs, targets = batch
        if inputs.ndim != 2 or inputs.is_floating_point():
            raise ValueError(f"tiny_gpt expects (batch, seq) integer tokens, got {inputs.dtype} {tuple(inputs.shape)}")
        length = inputs.shape[1]
        if length > self.spec.context:
            raise ValueError(f"sequence length {length} exceeds model.context ({self.spec.context})")
        pos = torch.arange(length, device=inputs.device)
        x = self.tok_emb(inputs) + self.pos_emb(pos)
        x = self._run_blocks(x)
        logits = self.head(self.ln_f(x)).float()
        flat = logits.view(-1, logits.shape[-1])
        ce = F.cross_entropy(flat, targets.reshape(-1))
        loss = ce
        if self.z_loss > 0:
            z = torch.logsumexp(flat, dim=-1).pow(2).mean()
            loss = ce + self.z_loss * z
            self.last_metrics = {"ce": ce.detach(), "z_loss": z.detach()}
        else:
            self.last_metrics = {"ce": ce.detach()}
        return loss


# -------------------------------------------------------------------------------------------------- deep_mlp
_ACTIVATIONS: dict[Activation, type[nn.Module]] = {
    Activation.relu: nn.ReLU,
    Activation.gelu: nn.GELU,
    Activation.tanh: nn.Tanh,
    Activation.sigmoid: nn.Sigmoid,
}
# Kaiming gains: the fan-in std that keeps activations' scale through a layer at init_scale = 1.
_GAINS = {Activation.relu: math.sqrt(2.0), Activation.gelu: math.sqrt(2.0), Activation.tanh: 5.0 / 3.0,
          Activation.sigmoid: 1.0}


class MLPBlock(nn.Module):
    def __init__(self, width: int, activation: Activation, residual: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.act = _ACTIVATIONS[activation]()
        self.residual = residual

    def forward(self, x: Tensor) -> Tensor:
        h: Tensor = self.act(self.linear(x))
        return x + h if self.residual else h


class DeepMLP(BallastModel):
    """Linear stem → ``depth`` hidden blocks → linear head; MSE loss. Blocks are the hidden layers.

    Hidden weights are N(0, (gain · init_scale)² / width) (fan-in init times the recipe's scale; the gain is the
    activation's Kaiming gain); stem and head use plain fan-in N(0, 1/fan_in); biases are zero.
    """

    def __init__(self, spec: DeepMLPModel, input_dim: int, output_dim: int) -> None:
        super().__init__()
        self.stem = nn.Linear(input_dim, spec.width)
        self.blocks = nn.ModuleList(MLPBlock(spec.width, spec.activation, spec.residual) for _ in range(spec.depth))
        self.head = nn.Linear(spec.width, output_dim)
        for lin in (self.stem, self.head):
            nn.init.normal_(lin.weight, std=1.0 / math.sqrt(lin.in_features))
            nn.init.zeros_(lin.bias)
        hidden_std = _GAINS[spec.activation] * spec.init_scale / math.sqrt(spec.width)
        for block in self.blocks:
            assert isinstance(block, MLPBlock)
            nn.init.normal_(block.linear.weight, std=hidden_std)
            nn.init.zeros_(block.linear.bias)

    def forward(self, batch: Batch) -> Tensor:
        inputs, targets = batch
        out = self.head(self._run_blocks(self.stem(inputs)))
        return F.mse_loss(out.float(), targets.float())


# ------------------------------------------------------------------------------------------------------- rnn
class RecurrentLayer(nn.Module):
    """One recurrent layer mapping a (batch, seq, in) sequence to (batch, seq, hidden) outputs."""

    def __init__(self, cell: RecurrentCell, input_size: int, hidden: int) -> None:
        super().__init__()
        cls = {RecurrentCell.rnn: nn.RNN, RecurrentCell.gru: nn.GRU, RecurrentCell.lstm: nn.LSTM}[cell]
        self.rnn = cls(input_size, hidden, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        out, _ = self.rnn(x)
        return out  # type: ignore[no-any-return]


class RecurrentNet(BallastModel):
    """Stacked single-layer RNN/GRU/LSTM layers and a linear per-position head; MSE loss.

    Blocks are the recurrent layers followed by the head (separate layers, so the depth profile and freezing
    see each one). PyTorch's default recurrent initialisation; with ``recurrent_spectral_radius`` ρ, each
    hidden-to-hidden matrix (each gate's block for GRU/LSTM) is then replaced by a random orthogonal matrix times ρ
    (every eigenvalue of modulus ρ), drawn after the default init from the same RNG, so ρ = None leaves every
    weight exactly as before.
    """

    def __init__(self, spec: RecurrentModel, input_dim: int, output_dim: int) -> None:
        super().__init__()
        layers: list[nn.Module] = [
            RecurrentLayer(spec.cell, input_dim if i == 0 else spec.hidden, spec.hidden) for i in range(spec.layers)
        ]
        layers.append(nn.Linear(spec.hidden, output_dim))
        self.blocks = nn.ModuleList(layers)
        if spec.recurrent_spectral_radius is not None:
            self._set_recurrent_spectral_radius(spec.recurrent_spectral_radius, spec.hidden)

    def _set_recurrent_spectral_radius(self, radius: float, hidden: int) -> None:
        with torch.no_grad():
            for block in self.blocks:
                if not isinstance(block, RecurrentLayer):
                    continue
                w = block.rnn.weight_hh_l0  # (gates * hidden, hidden): one square block per gate
                for gate in range(w.shape[0] // hidden):
                    square = torch.empty(hidden, hidden)
                    nn.init.orthogonal_(square)
                    w[gate * hidden:(gate + 1) * hidden].copy_(square * radius)

    def forward(self, batch: Batch) -> Tensor:
        inputs, targets = batch
        return F.mse_loss(self._run_blocks(inputs).float(), targets.float())


# ---------------------------------------------------------------------------------------------------- linear
class LinearRegression(BallastModel):
    """y = Wx (+ b); MSE loss. One block: the linear layer. Zero-initialised (the convex problem's usual start)."""

    def __init__(self, spec: LinearModel, input_dim: int, output_dim: int) -> None:
        super().__init__()
        linear = nn.Linear(input_dim, output_dim, bias=spec.bias)
        nn.init.zeros_(linear.weight)
        if linear.bias is not None:
            nn.init.zeros_(linear.bias)
        self.blocks = nn.ModuleList([linear])

    def forward(self, batch: Batch) -> Tensor:
        inputs, targets = batch
        return F.mse_loss(self.blocks[0](inputs).float(), targets.float())
