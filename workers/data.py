"""Built-in synthetic data: seeded, download-free, and addressable by batch index.

Every batch is generated from its own ``torch.Generator`` whose seed is a hash of (data spec, training seed, rank,
stream, index). No iterator state exists, so a resumed attempt, a rollback or a skipped data window replays exactly
by asking for the same indices again, and different ranks draw different (independent) batches.

Batch shapes (CPU tensors; the engine moves them to its device):

- ``markov`` (kind ``tokens``): inputs and targets ``(B, seq_len)`` int64, targets shifted by one token.
- ``regression`` (kind ``features``): inputs ``(B, dim)`` float32, targets ``(B, 1)`` float32 (with
  ``fixed_design``: rows of one fixed design matrix, so the loss Hessian and its λmax are known).
- ``sequence`` (kind ``sequence``): inputs and targets ``(B, seq_len, dim)`` float32.
- ``custom``: whatever the factory returns; dimensions are read off its first batch.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any, Literal, Protocol

import torch
from torch import Tensor

from contracts.recipe import CustomData, DataSpec, MarkovData, RegressionData, SequenceData, SequenceTask

DataKind = Literal["tokens", "features", "sequence"]

_IMPORT_RE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
# Largest Markov sampling table (vocab × resolution entries); bounds memory at 32 MiB of int64.
_MAX_TABLE_ENTRIES = 1 << 22
_MAX_POWER_ITERATIONS = 20_000


class SpecError(ValueError):
    """A model or data spec that cannot be built; the message starts with the offending field's path."""


class DataDims(Protocol):
    """What a model needs to know about its data (``build_model`` reads only these)."""

    @property
    def kind(self) -> DataKind: ...

    @property
    def input_dim(self) -> int | None: ...

    @property
    def output_dim(self) -> int | None: ...

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def seq_len(self) -> int | None: ...


# --------------------------------------------------------------------------------------------- import policy
def module_allowed(module: str, allowed_import_modules: Sequence[str]) -> bool:
    """The recipe's rule: the module equals an allowed prefix or lies below it (``a`` allows ``a.b``)."""
    return any(module == a or module.startswith(a + ".") for a in allowed_import_modules)


def resolve_import(ref: str, allowed_import_modules: Sequence[str], *, field: str) -> Callable[..., Any]:
    """Import ``module:function`` after re-checking the allow-list (never trust that validation ran earlier).

    The allow-list is checked *before* importing, because importing a module runs its code.
    """
    if not _IMPORT_RE.match(ref):
        raise SpecError(f"{field}: {ref!r} is not a 'module:function' import string")
    module_name, func_name = ref.split(":", 1)
    allowed = list(allowed_import_modules)
    if not module_allowed(module_name, allowed):
        raise SpecError(
            f"{field}: module {module_name!r} is not on the operator's allow-list "
            f"(BALLAST_ALLOWED_IMPORT_MODULES: {allowed})"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any failure inside user code becomes a clear spec error
        raise SpecError(f"{field}: cannot import module {module_name!r}: {type(exc).__name__}: {exc}") from exc
    func = getattr(module, func_name, None)
    if func is None:
        raise SpecError(f"{field}: module {module_name!r} has no attribute {func_name!r}")
    if not callable(func):
        raise SpecError(f"{field}: {ref!r} is not callable")
    return func  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------------------ seeding
def stream_seed(*parts: object) -> int:
    """A 63-bit seed from a hash of ``parts`` (stable across processes, unlike ``hash()``)."""
    text = "|".join(str(p) for p in parts).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1


# Fields added to a data section after its batches were first defined: left out of the stream key while they
# hold their default, so every batch of a recipe that does not use them stays bit-identical.
_KEY_NEUTRAL_DEFAULTS: dict[type, dict[str, Any]] = {RegressionData: {"fixed_design": False, "num_samples": 256}}


def _spec_key(spec: Any) -> str:
    dumped = spec.model_dump(mode="json")
    for name, default in _KEY_NEUTRAL_DEFAULTS.get(type(spec), {}).items():
        if dumped.get(name) == default:
            dumped.pop(name, None)
    return json.dumps(dumped, sort_keys=True, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------- the source
class DataSource(ABC):
    """One rank's view of a data set: ``batch(index)`` for training, ``eval_batch(index)`` held out.

    ``index`` is a micro-batch counter chosen by the engine (it must be a pure function of the step, e.g.
    ``(step + data_offset) * grad_accum_steps + micro``); the same index always gives the same batch.
    """

    kind: DataKind
    input_dim: int | None = None
    """Feature size per sample (features) or per position (sequence); None for tokens."""
    output_dim: int | None = None
    """Target size per sample/position; None for tokens."""
    vocab_size: int | None = None
    """Token vocabulary (tokens only)."""
    seq_len: int | None = None
    """Positions per sample (tokens, sequence)."""
    entropy_floor: float | None = None
    """Markov data: the exact conditional entropy of the source (nats/token), the lowest achievable CE."""
    loss_floor: float | None = None
    """The lowest achievable loss of a perfect model in the model's loss units (CE or MSE), when known."""

    def __init__(self, spec: Any, *, seed: int, batch_size: int, rank: int, world_size: int) -> None:
        if batch_size < 1:
            raise SpecError(f"training.batch_size: must be >= 1, got {batch_size}")
        if world_size < 1:
            raise SpecError(f"resources.num_workers: world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise SpecError(f"rank {rank} is outside [0, world_size={world_size})")
        self.spec = spec
        self.seed = seed
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self._key = _spec_key(spec)

    def _generator(self, stream: str, index: int) -> torch.Generator:
        if index < 0:
            raise ValueError(f"batch index must be >= 0, got {index}")
        return torch.Generator().manual_seed(stream_seed(self._key, self.seed, self.rank, stream, index))

    def batch(self, index: int) -> tuple[Tensor, Tensor]:
        """Training batch ``index`` of this rank: (inputs, targets)."""
        return self._make(self._generator("train", index), index, "train")

    def eval_batch(self, index: int) -> tuple[Tensor, Tensor]:
        """Held-out batch ``index`` of this rank, from a seed space disjoint from training batches."""
        return self._make(self._generator("eval", index), index, "eval")

    @property
    def tokens_per_batch(self) -> int | None:
        """Predicted tokens per batch (tokens data), for tokens/s telemetry."""
        if self.kind == "tokens" and self.seq_len is not None:
            return self.batch_size * self.seq_len
        return None

    @abstractmethod
    def _make(self, gen: torch.Generator, index: int, stream: str) -> tuple[Tensor, Tensor]: ...


# ------------------------------------------------------------------------------------------------- markov
class MarkovSource(DataSource):
    """A sparse Markov chain language with an exactly known entropy floor.

    The chain (built from ``spec.seed`` only, so every rank and attempt sees the same language) gives each token
    ``branching`` distinct successors. One successor of each token follows a random cyclic permutation, which
    makes the chain irreducible (a unique stationary distribution). Transition probabilities are multiples of
    ``1/resolution`` so sampling is one table lookup per position and the floor is exact for the sampled chain.
    Sequences start from the stationary distribution, so every target has the same conditional entropy.
    """

    kind: DataKind = "tokens"

    def __init__(self, spec: MarkovData, *, seed: int, batch_size: int, rank: int, world_size: int) -> None:
        super().__init__(spec, seed=seed, batch_size=batch_size, rank=rank, world_size=world_size)
        v = spec.vocab_size
        b = min(spec.branching, v)
        self.vocab_size = v
        self.seq_len = spec.seq_len
        self.branching = b
        mult = max(1, min(64, _MAX_TABLE_ENTRIES // (v * b)))
        self.resolution = b * mult
        g = torch.Generator().manual_seed(stream_seed("markov-language", spec.seed))
        # successors: column 0 follows a random cycle (irreducibility); the others are distinct offsets from it,
        # drawn as sorted uniform integers plus 0..b-2 (distinct without a dense vocab × vocab draw)
        perm = torch.randperm(v, generator=g)
        cycle_next = torch.empty(v, dtype=torch.long)
        cycle_next[perm] = torch.roll(perm, -1)
        draws = torch.randint(1, v - b + 2, (v, b - 1), generator=g).sort(dim=1).values
        offsets = draws + torch.arange(b - 1)
        succ = torch.cat([cycle_next[:, None], (cycle_next[:, None] + offsets) % v], dim=1)  # (v, b), distinct
        # probabilities: Gamma(2) weights quantised to counts over `resolution`, each count >= 1
        u = torch.rand(v, b, 2, generator=g, dtype=torch.float64).clamp_min(1e-12)
        w = -u.log().sum(-1)
        w = w / w.sum(1, keepdim=True)
        spare = self.resolution - b
        raw = w * spare
        counts = raw.floor().long()
        rem = spare - counts.sum(1)
        order = torch.argsort(torch.argsort(-(raw - counts), dim=1), dim=1)
        counts = counts + 1 + (order < rem[:, None]).long()
        self.successors = succ
        """(vocab, branching) successor tokens of each token."""
        self.probs = counts.double() / self.resolution
        """(vocab, branching) float64 transition probabilities; rows sum to 1 exactly."""
        self._table = torch.repeat_interleave(succ.flatten(), counts.flatten()).view(v, self.resolution)
        self._last_token = v - 1
        self.power_iterations = 0
        """Iterations the stationary distribution took (20,000 means it stopped at the cap, not converged)."""
        self.stationary = self._stationary()
        self._stationary_cdf = torch.cumsum(self.stationary, 0).float()
        self._stationary_cdf[-1] = 1.0
        row_entropy = -(self.probs * self.probs.log()).sum(1)
        self.entropy_floor = float((self.stationary * row_entropy).sum())
        self.loss_floor = self.entropy_floor

    def transition_matrix(self) -> Tensor:
        """Dense (vocab, vocab) float64 transition matrix (for tests and analysis; O(vocab²) memory)."""
        p = torch.zeros(self.vocab_size or 0, self.vocab_size or 0, dtype=torch.float64)
        p.scatter_(1, self.successors, self.probs)
        return p

    def _stationary(self) -> Tensor:
        """Stationary distribution by power iteration of the lazy chain ½(I + P): same fixed point, aperiodic."""
        v = self.vocab_size or 0
        pi = torch.full((v,), 1.0 / v, dtype=torch.float64)
        if self.branching == 1:
            return pi  # a single cyclic permutation: uniform is stationary
        flat_succ = self.successors.flatten()
        for i in range(_MAX_POWER_ITERATIONS):
            step = torch.zeros_like(pi).index_add_(0, flat_succ, (pi[:, None] * self.probs).flatten())
            new = 0.5 * (pi + step)
            delta = float((new - pi).abs().sum())
            pi = new / new.sum()
            if delta < 1e-13:
                self.power_iterations = i + 1
                break
        else:
            self.power_iterations = _MAX_POWER_ITERATIONS
        return pi

    def _make(self, gen: torch.Generator, index: int, stream: str) -> tuple[Tensor, Tensor]:
        bsz, length = self.batch_size, self.seq_len or 0
        start_u = torch.rand(bsz, generator=gen)
        cur = torch.searchsorted(self._stationary_cdf, start_u, right=True).clamp_max(self._last_token)
        picks = torch.randint(self.resolution, (length, bsz), generator=gen)
        seq = torch.empty(bsz, length + 1, dtype=torch.long)
        seq[:, 0] = cur
        table = self._table
        for t in range(length):  # the chain is sequential; each step is one vectorised lookup over the batch
            cur = table[cur, picks[t]]
            seq[:, t + 1] = cur
        return seq[:, :-1], seq[:, 1:]


# --------------------------------------------------------------------------------------------- regression
class RegressionSource(DataSource):
    """x ~ N(0, Σ) with cond(Σ) = ``condition``, y = w·x + noise·ε, with wᵀΣw = 1 so Var(y) = 1 + noise².

    Σ = Q diag(λ) Qᵀ with λ log-spaced from 1 down to 1/condition and Q a random rotation; Q and w come from
    ``spec.seed`` (the same function on every rank and attempt). The MSE floor is ``noise²``.

    ``fixed_design``: a design matrix X of ``num_samples`` rows and its labels (noise included) are drawn once
    from ``spec.seed`` and shared by every rank and attempt; training batch ``index`` is ``batch_size`` distinct
    rows drawn uniformly from X (every row, in order, when ``batch_size == num_samples``: full-batch gradient
    descent). Eval batches are fresh draws from the same distribution (generalisation). The full-batch MSE of a
    linear model is then a fixed quadratic whose Hessian is known exactly: ``hessian_lambda_max`` (below) is its
    largest eigenvalue, so plain gradient descent is stable for ``lr < 2 / hessian_lambda_max`` and diverges
    beyond. ``loss_floor`` stays ``noise²`` (the population floor; the training set's own least-squares optimum
    is slightly lower, ``design_loss_floor``).
    """

    kind: DataKind = "features"
    design_inputs: Tensor | None = None
    """fixed_design: the (num_samples, dim) float32 design matrix X."""
    design_targets: Tensor | None = None
    """fixed_design: the (num_samples, 1) float32 labels of X."""
    hessian_lambda_max: float | None = None
    """fixed_design: largest eigenvalue of the Hessian of the full-batch MSE of the built-in ``linear`` model with
    an intercept, 2 · λmax([X 1]ᵀ[X 1] / N) (``hessian_lambda_max_no_bias`` without the intercept); plain
    (momentum-free) full-batch gradient descent diverges for lr > 2 / hessian_lambda_max."""
    hessian_lambda_max_no_bias: float | None = None
    """fixed_design: 2 · λmax(XᵀX / N), the same for ``linear`` with ``bias: false``."""
    design_loss_floor: float | None = None
    """fixed_design: the least-squares optimum of the full-batch MSE on X (with an intercept)."""

    def __init__(self, spec: RegressionData, *, seed: int, batch_size: int, rank: int, world_size: int) -> None:
        super().__init__(spec, seed=seed, batch_size=batch_size, rank=rank, world_size=world_size)
        d = spec.dim
        self.input_dim = d
        self.output_dim = 1
        g = torch.Generator().manual_seed(stream_seed("regression-task", spec.seed))
        q, _ = torch.linalg.qr(torch.randn(d, d, generator=g, dtype=torch.float64))
        if d > 1:
            lam = torch.logspace(0.0, -math.log10(spec.condition), d, dtype=torch.float64)
        else:
            lam = torch.ones(1, dtype=torch.float64)
        w = torch.randn(d, generator=g, dtype=torch.float64)
        w = w / torch.sqrt(((q.T @ w) ** 2 * lam).sum())
        self.covariance = (q * lam) @ q.T
        self.weights = w
        self._mix = (q * lam.sqrt()).T.float()  # x = z @ mix, z ~ N(0, I)
        self._w = w.float()[:, None]
        self.noise = spec.noise
        self.loss_floor = spec.noise**2
        self.fixed_design = spec.fixed_design
        if spec.fixed_design:
            self._build_design(spec)

    def _build_design(self, spec: RegressionData) -> None:
        n = spec.num_samples
        if self.batch_size > n:
            raise SpecError(f"training.batch_size: {self.batch_size} exceeds data.num_samples ({n}) of the fixed "
                            "design (a batch is distinct rows of it)")
        g = torch.Generator().manual_seed(stream_seed("regression-design", spec.seed, n))
        z = torch.randn(n, self.input_dim or 0, generator=g)
        x = z @ self._mix
        y = x @ self._w
        if self.noise > 0:
            y = y + self.noise * torch.randn(n, 1, generator=g)
        self.design_inputs, self.design_targets = x, y
        xd = x.double()
        aug = torch.cat([xd, torch.ones(n, 1, dtype=torch.float64)], dim=1)
        self.hessian_lambda_max = float(2.0 * torch.linalg.eigvalsh(aug.T @ aug / n).max())
        self.hessian_lambda_max_no_bias = float(2.0 * torch.linalg.eigvalsh(xd.T @ xd / n).max())
        coef = torch.linalg.lstsq(aug, y.double()).solution
        self.design_loss_floor = float(((aug @ coef - y.double()) ** 2).mean())

    def _make(self, gen: torch.Generator, index: int, stream: str) -> tuple[Tensor, Tensor]:
        if self.design_inputs is not None and self.design_targets is not None and stream == "train":
            n = self.design_inputs.shape[0]
            if self.batch_size == n:
                return self.design_inputs.clone(), self.design_targets.clone()
            rows = torch.randperm(n, generator=gen)[: self.batch_size]
            return self.design_inputs[rows], self.design_targets[rows]
        z = torch.randn(self.batch_size, self.input_dim or 0, generator=gen)
        x = z @ self._mix
        y = x @ self._w
        if self.noise > 0:
            y = y + self.noise * torch.randn(self.batch_size, 1, generator=gen)
        return x, y


# ----------------------------------------------------------------------------------------------- sequence
class SequenceSource(DataSource):
    """Per-position regression for recurrent models; inputs are N(0, 1) features.

    - ``running_sum``: y_t = (x_0 + … + x_t) / √(t+1) (unit variance at every position; needs unbounded memory).
    - ``copy``: y_t = x_{t-d} for t ≥ d, else 0, with delay d = max(1, seq_len // 4) (needs d steps of memory).
    Both are noise-free, so the MSE floor is 0.
    """

    kind: DataKind = "sequence"

    def __init__(self, spec: SequenceData, *, seed: int, batch_size: int, rank: int, world_size: int) -> None:
        super().__init__(spec, seed=seed, batch_size=batch_size, rank=rank, world_size=world_size)
        self.input_dim = spec.dim
        self.output_dim = spec.dim
        self.seq_len = spec.seq_len
        self.task = spec.task
        self.delay = max(1, spec.seq_len // 4)
        self.loss_floor = 0.0
        self._norm = torch.arange(1, spec.seq_len + 1, dtype=torch.float32).rsqrt()[None, :, None]

    def _make(self, gen: torch.Generator, index: int, stream: str) -> tuple[Tensor, Tensor]:
        x = torch.randn(self.batch_size, self.seq_len or 0, self.input_dim or 0, generator=gen)
        if self.task is SequenceTask.running_sum:
            y = x.cumsum(1) * self._norm
        else:
            y = torch.zeros_like(x)
            y[:, self.delay :] = x[:, : -self.delay]
        return x, y


# ------------------------------------------------------------------------------------------------- custom
class CustomSource(DataSource):
    """User data: ``factory(index, batch_size, seed, **params) -> (inputs, targets)``.

    ``seed`` passed to the factory is already mixed with the rank and the stream (train/eval), so a factory that
    seeds its own generator from it is deterministic per (seed, rank, index) and eval batches are disjoint.
    Dimensions are read off training batch 0: integer inputs → tokens, 2-D float → features, 3-D float → sequence.
    """

    def __init__(
        self,
        spec: CustomData,
        *,
        seed: int,
        batch_size: int,
        rank: int,
        world_size: int,
        allowed_import_modules: Sequence[str],
    ) -> None:
        super().__init__(spec, seed=seed, batch_size=batch_size, rank=rank, world_size=world_size)
        self._factory = resolve_import(spec.factory, allowed_import_modules, field="data.factory")
        self._params = dict(spec.params)
        inputs, targets = self.batch(0)
        if not inputs.is_floating_point():
            self.kind = "tokens"
            self.seq_len = int(inputs.shape[1]) if inputs.ndim >= 2 else None
        else:
            if inputs.ndim not in (2, 3):
                raise SpecError(f"data.factory: float inputs must be 2-D or 3-D, got shape {tuple(inputs.shape)}")
            self.kind = "features" if inputs.ndim == 2 else "sequence"
            self.input_dim = int(inputs.shape[-1])
            self.output_dim = int(targets.shape[-1]) if targets.ndim == inputs.ndim else 1
            self.seq_len = int(inputs.shape[1]) if inputs.ndim == 3 else None

    def _make(self, gen: torch.Generator, index: int, stream: str) -> tuple[Tensor, Tensor]:
        seed = stream_seed(self._key, self.seed, self.rank, stream, "custom")
        try:
            out = self._factory(index, self.batch_size, seed, **self._params)
        except Exception as exc:
            raise SpecError(f"data.factory: {self.spec.factory} raised {type(exc).__name__}: {exc}") from exc
        if (
            not isinstance(out, tuple | list)
            or len(out) != 2
            or not all(isinstance(t, Tensor) for t in out)
        ):
            raise SpecError("data.factory: must return a pair of tensors (inputs, targets)")
        inputs, targets = out
        if inputs.ndim == 0 or targets.ndim == 0 or inputs.shape[0] != targets.shape[0]:
            raise SpecError(
                f"data.factory: inputs and targets need the same leading batch dimension, got "
                f"{tuple(inputs.shape)} and {tuple(targets.shape)}"
            )
        return inputs, targets


# -------------------------------------------------------------------------------------------------- build
def build_data(
    spec: DataSpec,
    *,
    seed: int,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    allowed_import_modules: Sequence[str] = (),
) -> DataSource:
    """The recipe's ``data`` section → this rank's ``DataSource`` (``seed`` is ``training.seed``)."""
    kw: dict[str, Any] = {"seed": seed, "batch_size": batch_size, "rank": rank, "world_size": world_size}
    if isinstance(spec, MarkovData):
        return MarkovSource(spec, **kw)
    if isinstance(spec, RegressionData):
        return RegressionSource(spec, **kw)
    if isinstance(spec, SequenceData):
        return SequenceSource(spec, **kw)
    if isinstance(spec, CustomData):
        return CustomSource(spec, allowed_import_modules=allowed_import_modules, **kw)
    raise SpecError(f"data.name: unknown data spec {type(spec).__name__}")
