"""Built-in models (and user models from allow-listed import strings) behind one small contract.

Every model ``m`` returned by :func:`build_model`:

- ``m(batch)`` with ``batch = (inputs, targets)`` returns the **scalar mean loss** (float32, 0-dim), so the engine
  never needs to know which loss a model uses;
- has ``m.blocks`` (an ``nn.ModuleList`` or list of submodules) in input → output order. Freezing, activation
  checkpointing and the per-layer depth profile work on blocks. Built-in models register them as
  ``blocks.{i}.*`` parameters; :func:`param_block_index` maps any model's parameter names to block indices.

Built-in models also subclass :class:`BallastModel`, which adds ``set_activation_checkpointing``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from contracts.recipe import (
    Activation,
    CustomModel,
    DeepMLPModel,
    LinearModel,
    ModelSpec,
    NormPosition,
    RecurrentCell,
    RecurrentModel,
    TinyGPTModel,
)
from workers.data import DataDims, SpecError, resolve_import

Batch = tuple[Tensor, Tensor]


class BallastModel(nn.Module):
    """Base of the built-in models: ``forward(batch) -> scalar loss`` and ``blocks`` in input → output order."""

    blocks: nn.ModuleList
    supports_activation_checkpointing = False

    def __init__(self) -> None:
        super().__init__()
        self.activation_checkpointing = False

    def set_activation_checkpointing(self, enabled: bool) -> None:
        """Recompute each block's activations in the backward pass (memory for compute; same gradients)."""
        if enabled and not self.supports_activation_checkpointing:
            raise SpecError(
                f"distributed.activation_checkpointing: not supported by model {type(self).__name__} "
                "(tiny_gpt and deep_mlp support it)"
            )
        self.activation_checkpointing = enabled

    def _run_blocks(self, x: Tensor) -> Tensor:
        use_ckpt = self.activation_checkpointing and self.training and torch.is_grad_enabled()
        for block in self.blocks:
            if use_ckpt:
                x = checkpoint(block, x, use_reentrant=False)
            else:
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

    supports_activation_checkpointing = True

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

    supports_activation_checkpointing = True

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
        x = inputs
        for block in self.blocks:
            x = block(x)
        return F.mse_loss(x.float(), targets.float())


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


# ----------------------------------------------------------------------------------------------------- build
def _need_dims(spec_name: str, data: DataDims | None, kind: str) -> tuple[int, int]:
    if data is None:
        raise SpecError(f"model.name: {spec_name} needs the data's dimensions (pass data= to build_model)")
    if data.kind != kind or data.input_dim is None or data.output_dim is None:
        raise SpecError(f"data.name: model {spec_name!r} needs {kind} data, got {data.kind} data")
    return data.input_dim, data.output_dim


def _build(spec: ModelSpec, data: DataDims | None, allowed_import_modules: Sequence[str]) -> nn.Module:
    if isinstance(spec, TinyGPTModel):
        if data is not None:
            if data.kind != "tokens":
                raise SpecError(f"data.name: model 'tiny_gpt' needs token data, got {data.kind} data")
            if data.vocab_size is not None and data.vocab_size != spec.vocab_size:
                raise SpecError(f"data.vocab_size: must equal model.vocab_size ({spec.vocab_size}), "
                                f"got {data.vocab_size}")
            if data.seq_len is not None and data.seq_len > spec.context:
                raise SpecError(f"data.seq_len: {data.seq_len} exceeds model.context ({spec.context})")
        return TinyGPT(spec)
    if isinstance(spec, DeepMLPModel):
        return DeepMLP(spec, *_need_dims("deep_mlp", data, "features"))
    if isinstance(spec, LinearModel):
        return LinearRegression(spec, *_need_dims("linear", data, "features"))
    if isinstance(spec, RecurrentModel):
        return RecurrentNet(spec, *_need_dims("rnn", data, "sequence"))
    if isinstance(spec, CustomModel):
        factory = resolve_import(spec.factory, allowed_import_modules, field="model.factory")
        try:
            model = factory(**spec.params)
        except Exception as exc:
            raise SpecError(f"model.factory: {spec.factory} raised {type(exc).__name__}: {exc}") from exc
        return model  # type: ignore[no-any-return]
    raise SpecError(f"model.name: unknown model spec {type(spec).__name__}")


def validate_model(model: object, *, field: str = "model.factory", probe: Batch | None = None) -> nn.Module:
    """Check the model contract (clear SpecError otherwise): an nn.Module with non-empty ``blocks`` that are its
    own submodules, and, given a probe batch, a forward returning a finite-dtype scalar tensor.

    The probe runs in eval mode under ``no_grad`` with the RNG forked, so it changes no state.
    """
    if not isinstance(model, nn.Module):
        raise SpecError(f"{field}: must return a torch.nn.Module, got {type(model).__name__}")
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleList | list | tuple) or len(blocks) == 0:
        raise SpecError(f"{field}: the model must have a non-empty `blocks` list of modules (input → output order)")
    own = {id(m) for m in model.modules()}
    for i, block in enumerate(blocks):
        if not isinstance(block, nn.Module) or id(block) not in own:
            raise SpecError(f"{field}: blocks[{i}] must be a submodule of the model")
    if probe is not None:
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                out = model(probe)
        except Exception as exc:
            raise SpecError(
                f"{field}: forward((inputs, targets)) failed on a data batch: {type(exc).__name__}: {exc}"
            ) from exc
        finally:
            model.train(was_training)
        if not isinstance(out, Tensor) or out.numel() != 1 or out.ndim != 0 or not out.is_floating_point():
            desc = f"tensor {out.dtype} {tuple(out.shape)}" if isinstance(out, Tensor) else type(out).__name__
            raise SpecError(f"{field}: forward(batch) must return the scalar mean loss (0-dim float), got {desc}")
    return model


def build_model(
    spec: ModelSpec,
    data: DataDims | None = None,
    *,
    seed: int | None = None,
    allowed_import_modules: Sequence[str] = (),
) -> nn.Module:
    """The recipe's ``model`` section → a model that honours the contract in this module's docstring.

    ``data`` (a ``DataSource``) supplies input/output sizes; it is required for deep_mlp, linear and rnn, checked
    against tiny_gpt (vocab, context), and used to probe a custom model's forward on ``data.batch(0)``.
    With ``seed``, initialisation draws from that seed under a forked RNG (the global RNG is left untouched);
    without it, from the global RNG. ``allowed_import_modules`` is re-checked here for custom factories.
    """
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = _build(spec, data, allowed_import_modules)
    else:
        model = _build(spec, data, allowed_import_modules)
    if isinstance(spec, CustomModel):
        probe: Batch | None = None
        batch_fn = getattr(data, "batch", None)
        if callable(batch_fn):
            probe = batch_fn(0)
        validate_model(model, probe=probe)
    return model


# ------------------------------------------------------------------------------------------------ utilities
def model_blocks(model: nn.Module) -> list[nn.Module]:
    """``model.blocks`` as a list, looking through a DDP wrapper (``.module``)."""
    inner = getattr(model, "module", model) if not hasattr(model, "blocks") else model
    blocks = getattr(inner, "blocks", None)
    if blocks is None:
        raise SpecError(f"model: {type(inner).__name__} has no `blocks`")
    return list(blocks)


def set_activation_checkpointing(model: nn.Module, enabled: bool) -> None:
    """Turn activation checkpointing on or off; a clear error for models that cannot (rnn, linear, custom)."""
    inner = getattr(model, "module", model) if not isinstance(model, BallastModel) else model
    if isinstance(inner, BallastModel):
        inner.set_activation_checkpointing(enabled)
    elif enabled:
        raise SpecError(
            f"distributed.activation_checkpointing: not supported by model {type(inner).__name__} "
            "(tiny_gpt and deep_mlp support it)"
        )


def freeze_first_n_blocks(model: nn.Module, n: int) -> list[str]:
    """Set ``requires_grad=False`` on every parameter of ``blocks[:n]`` and return their names.

    Only blocks are frozen: embeddings, stems and heads stay trainable. Call it before wrapping in DDP (DDP
    registers only parameters that require grad) and before building the optimizer, which should receive only
    trainable parameters (a frozen parameter then never moves, even with weight decay).
    """
    blocks = model_blocks(model)
    if n < 0 or n > len(blocks):
        raise SpecError(f"distributed.freeze_first_n_blocks: {n} is outside [0, {len(blocks)}] (the model's blocks)")
    frozen_ids = set()
    for block in blocks[:n]:
        for p in block.parameters():
            p.requires_grad_(False)
            frozen_ids.add(id(p))
    return [name for name, p in model.named_parameters() if id(p) in frozen_ids]


def param_block_index(model: nn.Module) -> dict[str, int]:
    """Parameter name → index of the block that owns it; parameters outside every block are left out."""
    owner: dict[int, int] = {}
    for i, block in enumerate(model_blocks(model)):
        for p in block.parameters():
            owner.setdefault(id(p), i)
    return {name: owner[id(p)] for name, p in model.named_parameters() if id(p) in owner}
