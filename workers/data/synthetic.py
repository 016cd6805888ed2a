"""Built-in synthetic data: seeded, download-free, with known loss floors.

Every batch is generated from its own ``torch.Generator`` whose seed is a hash of (data spec, training seed, rank,
stream, index). No iterator state exists, so a resumed attempt, a rollback or a skipped data window replays exactly
by asking for the same indices again, and different ranks draw different (independent) batches.

Batch shapes (CPU tensors; the engine moves them to its device):

- ``markov`` (kind ``tokens``): inputs and targets ``(B, seq_len)`` int64, targets shifted by one token.
- ``regression`` (kind ``features``): inputs ``(B, dim)`` float32, targets ``(B, 1)`` float32 (with
  ``fixed_design``: rows of one fixed design matrix, so the loss Hessian and its λmax are known).
- ``sequence`` (kind ``sequence``): inputs and targets ``(B, seq_len, dim)`` float32.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from contracts.recipe import MarkovData, RegressionData, SequenceData, SequenceTask
from workers.data.base import DataKind, DataSource, SpecError, stream_seed

# Largest Markov sampling table (vocab × resolution entries); bounds memory at 32 MiB of int64.
_MAX_TABLE_ENTRIES = 1 << 22
_MAX_POWER_ITERATIONS = 20_000


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
        # every target is marginally stationary (sequences start there): the best fixed guess is the stationary
        # distribution itself, and its cross-entropy is that distribution's entropy
        pi = self.stationary[self.stationary > 0]
        self.trivial_loss = float(-(pi * pi.log()).sum())

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
        self.trivial_loss = 1.0 + spec.noise**2  # E[y] = 0 and Var(y) = wᵀΣw + noise² = 1 + noise²
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
        self.trivial_loss = float(y.double().var(correction=0))  # training batches are rows of X: their mean

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
        # zero-mean, unit-variance targets (running_sum everywhere; copy after the delay, zero before it)
        self.trivial_loss = 1.0 if spec.task is SequenceTask.running_sum else (spec.seq_len - self.delay) / spec.seq_len
        self._norm = torch.arange(1, spec.seq_len + 1, dtype=torch.float32).rsqrt()[None, :, None]

    def _make(self, gen: torch.Generator, index: int, stream: str) -> tuple[Tensor, Tensor]:
        x = torch.randn(self.batch_size, self.seq_len or 0, self.input_dim or 0, generator=gen)
        if self.task is SequenceTask.running_sum:
            y = x.cumsum(1) * self._norm
        else:
            y = torch.zeros_like(x)
            y[:, self.delay :] = x[:, : -self.delay]
        return x, y
