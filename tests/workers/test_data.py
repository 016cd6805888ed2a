"""Built-in data: shapes, determinism by index, the Markov entropy floor, and custom data behind the allow-list."""

from __future__ import annotations

import math
import sys
from typing import Any

import pytest
import torch

from contracts.recipe import (
    CustomData,
    DeepMLPModel,
    MarkovData,
    RecurrentModel,
    RegressionData,
    SequenceData,
    TinyGPTModel,
)
from workers.data import MarkovSource, SpecError, build_data
from workers.models import build_model
from workers.objective import Objective

FIXTURES = "ballast_custom_fixtures"




def _custom_data(factory: str = f"{FIXTURES}:make_batch", **params: object) -> CustomData:
    # validation context with the module allowed, so the spec itself is valid; build_data re-checks on its own
    return CustomData.model_validate(
        {"factory": factory, "params": params}, context={"allowed_import_modules": [FIXTURES]}
    )


SPECS: dict[str, MarkovData | RegressionData | SequenceData] = {
    "markov": MarkovData(vocab_size=16, seq_len=12, branching=3),
    "regression": RegressionData(dim=5, condition=10.0, noise=0.1),
    "running_sum": SequenceData(task="running_sum", seq_len=10, dim=3),
    "copy": SequenceData(task="copy", seq_len=12, dim=2),
}


@pytest.mark.parametrize(
    ("name", "x_shape", "y_shape", "x_dtype"),
    [
        ("markov", (4, 12), (4, 12), torch.int64),
        ("regression", (4, 5), (4, 1), torch.float32),
        ("running_sum", (4, 10, 3), (4, 10, 3), torch.float32),
        ("copy", (4, 12, 2), (4, 12, 2), torch.float32),
    ],
)
def test_batch_shapes_and_dtypes(name: str, x_shape: tuple[int, ...], y_shape: tuple[int, ...],
                                 x_dtype: torch.dtype) -> None:
    data = build_data(SPECS[name], seed=0, batch_size=4)
    x, y = data.batch(0)
    assert tuple(x.shape) == x_shape and tuple(y.shape) == y_shape
    assert x.dtype == x_dtype
    ex, ey = data.eval_batch(0)
    assert ex.shape == x.shape and ey.shape == y.shape


@pytest.mark.parametrize("name", list(SPECS))
def test_batches_are_a_pure_function_of_seed_rank_and_index(name: str) -> None:
    spec = SPECS[name]
    a = build_data(spec, seed=3, batch_size=4, rank=0, world_size=2)
    resumed = build_data(spec, seed=3, batch_size=4, rank=0, world_size=2)  # a fresh process after a resume
    other_rank = build_data(spec, seed=3, batch_size=4, rank=1, world_size=2)
    other_seed = build_data(spec, seed=4, batch_size=4, rank=0, world_size=2)
    a.batch(5)  # asking out of order must not matter: there is no iterator state
    for index in (0, 7, 123456):
        x, y = a.batch(index)
        rx, ry = resumed.batch(index)
        assert torch.equal(x, rx) and torch.equal(y, ry)
        assert not torch.equal(x, other_rank.batch(index)[0])
        assert not torch.equal(x, other_seed.batch(index)[0])
        assert not torch.equal(x, a.batch(index + 1)[0])
        assert not torch.equal(x, a.eval_batch(index)[0])  # held-out stream is disjoint


def test_negative_index_is_refused() -> None:
    with pytest.raises(ValueError, match="index"):
        build_data(SPECS["markov"], seed=0, batch_size=2).batch(-1)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"batch_size": 0}, "training.batch_size"), ({"rank": 2, "world_size": 2}, "rank 2"),
     ({"world_size": 0}, "world_size")],
)
def test_bad_build_arguments_name_the_problem(kwargs: dict[str, int], field: str) -> None:
    args: dict[str, Any] = {"seed": 0, "batch_size": 2, **kwargs}
    with pytest.raises(SpecError, match=field):
        build_data(SPECS["markov"], **args)


# ------------------------------------------------------------------------------------------------- markov
def _markov(**kw: int) -> MarkovSource:
    data = build_data(MarkovData(**kw), seed=0, batch_size=64)
    assert isinstance(data, MarkovSource)
    return data


def test_markov_targets_are_inputs_shifted_and_follow_the_chain() -> None:
    data = _markov(vocab_size=32, seq_len=16, branching=4)
    p = data.transition_matrix()
    x, y = data.batch(0)
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert bool((p[x, y] > 0).all())  # every observed transition is one of the chain's successors
    assert bool(((p > 0).sum(1) == 4).all())
    assert torch.allclose(p.sum(1), torch.ones(32, dtype=torch.float64))


def test_markov_language_depends_on_its_own_seed_only() -> None:
    a = build_data(MarkovData(seed=1), seed=0, batch_size=2)
    b = build_data(MarkovData(seed=1), seed=99, batch_size=2, rank=1, world_size=2)
    c = build_data(MarkovData(seed=2), seed=0, batch_size=2)
    assert isinstance(a, MarkovSource) and isinstance(b, MarkovSource) and isinstance(c, MarkovSource)
    assert torch.equal(a.transition_matrix(), b.transition_matrix())
    assert not torch.equal(a.transition_matrix(), c.transition_matrix())


def test_markov_stationary_distribution_matches_a_dense_solve() -> None:
    data = _markov(vocab_size=24, seq_len=8, branching=3)
    p = data.transition_matrix()
    # solve pi (P - I) = 0 with sum(pi) = 1 as a least-squares system: independent of the power iteration
    a = torch.cat([(p - torch.eye(24, dtype=torch.float64)).T, torch.ones(1, 24, dtype=torch.float64)])
    b = torch.cat([torch.zeros(24, dtype=torch.float64), torch.ones(1, dtype=torch.float64)])
    pi = torch.linalg.lstsq(a, b[:, None]).solution.flatten()
    assert torch.allclose(data.stationary, pi, atol=1e-10)
    rows = -(torch.where(p > 0, p * p.log(), torch.zeros_like(p))).sum(1)
    assert data.entropy_floor == pytest.approx(float((pi * rows).sum()), abs=1e-10)


@pytest.mark.parametrize("branching", [2, 4, 8])
def test_markov_entropy_floor_matches_the_empirical_entropy(branching: int) -> None:
    data = _markov(vocab_size=32, seq_len=32, branching=branching)
    p = data.transition_matrix()
    nll = torch.cat([-p[x, y].log().flatten() for x, y in (data.batch(i) for i in range(40))])  # 81,920 tokens
    # the mean surprisal under the true chain estimates its conditional entropy; allow 5 standard errors
    se = float(nll.std()) / math.sqrt(nll.numel())
    assert data.entropy_floor is not None
    assert float(nll.mean()) == pytest.approx(data.entropy_floor, abs=5 * se + 1e-3)
    assert 0.0 < data.entropy_floor < math.log(branching)
    assert data.loss_floor == data.entropy_floor


def test_markov_empirical_transition_frequencies_match_the_matrix() -> None:
    data = _markov(vocab_size=8, seq_len=32, branching=3)
    p = data.transition_matrix()
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for i in range(40):
        x, y = data.batch(i)
        counts.index_put_((x.flatten(), y.flatten()), torch.ones(x.numel(), dtype=torch.float64), accumulate=True)
    freq = counts / counts.sum(1, keepdim=True)
    assert float((freq - p).abs().max()) < 0.03
    start_freq = torch.bincount(torch.cat([data.batch(i)[0][:, 0] for i in range(40)]), minlength=8).double()
    assert float((start_freq / start_freq.sum() - data.stationary).abs().max()) < 0.05  # starts are stationary


def test_markov_branching_one_is_deterministic_with_zero_floor() -> None:
    data = _markov(vocab_size=10, seq_len=8, branching=1)
    assert data.entropy_floor == 0.0
    p = data.transition_matrix()
    x, y = data.batch(0)
    assert torch.equal(y, p.argmax(1)[x])


def test_markov_large_vocab_builds_without_a_dense_matrix() -> None:
    data = build_data(MarkovData(vocab_size=65536, seq_len=8, branching=4), seed=0, batch_size=2)
    x, y = data.batch(0)
    assert int(x.max()) < 65536 and data.entropy_floor is not None and data.entropy_floor > 0


# --------------------------------------------------------------------------------------------- regression
def test_regression_has_the_requested_conditioning_and_noise() -> None:
    spec = RegressionData(dim=6, condition=50.0, noise=0.2, seed=5)
    data = build_data(spec, seed=0, batch_size=20000)
    x, y = data.batch(0)
    eig = torch.linalg.eigvalsh(torch.cov(x.T.double()))
    assert float(eig.max() / eig.min()) == pytest.approx(50.0, rel=0.15)
    assert float(y.var()) == pytest.approx(1.0 + 0.2**2, rel=0.05)
    resid = y.double().flatten() - x.double() @ data.weights  # type: ignore[attr-defined]
    assert float(resid.std()) == pytest.approx(0.2, rel=0.05)
    assert data.loss_floor == pytest.approx(0.04)


# ----------------------------------------------------------------------------------------------- sequence
def test_running_sum_targets() -> None:
    x, y = build_data(SPECS["running_sum"], seed=0, batch_size=3).batch(2)
    t = torch.arange(1, 11, dtype=torch.float32)[None, :, None]
    torch.testing.assert_close(y, x.cumsum(1) / t.sqrt())


def test_copy_targets_are_delayed_inputs() -> None:
    data = build_data(SPECS["copy"], seed=0, batch_size=3)
    x, y = data.batch(0)
    d = 3  # seq_len 12 // 4
    assert torch.equal(y[:, d:], x[:, :-d])
    assert bool((y[:, :d] == 0).all())
    assert data.loss_floor == 0.0


# ------------------------------------------------------------------------------------------------- custom
@pytest.mark.usefixtures("fixtures_on_path")
def test_custom_data_refused_unless_allow_listed() -> None:
    sys.modules.pop(FIXTURES, None)
    with pytest.raises(SpecError, match=r"data\.factory: module 'ballast_custom_fixtures' is not on the"):
        build_data(_custom_data(), seed=0, batch_size=2, allowed_import_modules=["ballast_custom"])
    assert FIXTURES not in sys.modules  # refused before import: the module's code never ran


@pytest.mark.usefixtures("fixtures_on_path")
def test_custom_data_accepted_when_allowed_and_deterministic_per_rank() -> None:
    spec = _custom_data(dim=4)
    data = build_data(spec, seed=1, batch_size=5, allowed_import_modules=[FIXTURES])
    again = build_data(spec, seed=1, batch_size=5, allowed_import_modules=[FIXTURES])
    rank1 = build_data(spec, seed=1, batch_size=5, rank=1, world_size=2, allowed_import_modules=[FIXTURES])
    assert (data.kind, data.input_dim, data.output_dim) == ("features", 4, 1)
    x, y = data.batch(3)
    assert x.shape == (5, 4)
    assert torch.equal(x, again.batch(3)[0])
    assert not torch.equal(x, rank1.batch(3)[0])
    assert not torch.equal(x, data.eval_batch(3)[0])


@pytest.mark.usefixtures("fixtures_on_path")
@pytest.mark.parametrize(
    ("factory", "message"),
    [(f"{FIXTURES}:make_bad_batch", "pair of tensors"), (f"{FIXTURES}:make_model", "raised TypeError"),
     (f"{FIXTURES}:nope", "has no attribute 'nope'")],
)
def test_custom_data_bad_factory_is_a_clear_error(factory: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        build_data(_custom_data(factory), seed=0, batch_size=2, allowed_import_modules=[FIXTURES])


# ------------------------------------------------------------------------------------ fixed-design regression
def test_regression_default_batches_are_unchanged_by_the_fixed_design_fields() -> None:
    """The stream key leaves the new fields out at their defaults: today's recipes see bit-identical batches."""
    from workers.data import _spec_key

    spec = RegressionData(dim=5, condition=10.0, noise=0.1)
    assert "fixed_design" not in _spec_key(spec) and "num_samples" not in _spec_key(spec)
    x, y = build_data(spec, seed=0, batch_size=3).batch(0)
    assert build_data(spec, seed=0, batch_size=3).design_inputs is None  # type: ignore[attr-defined]
    assert "fixed_design" in _spec_key(RegressionData(dim=5, fixed_design=True))
    assert torch.equal(x, build_data(RegressionData(dim=5, condition=10.0, noise=0.1, num_samples=256),
                                     seed=0, batch_size=3).batch(0)[0])


def test_fixed_design_batches_are_rows_of_one_matrix_with_a_known_hessian() -> None:
    spec = RegressionData(dim=6, condition=10.0, noise=0.1, seed=2, fixed_design=True, num_samples=40)
    data = build_data(spec, seed=0, batch_size=8)
    other_rank = build_data(spec, seed=0, batch_size=8, rank=1, world_size=2)
    x_all, y_all = data.design_inputs, data.design_targets  # type: ignore[attr-defined]
    assert x_all.shape == (40, 6) and y_all.shape == (40, 1)
    assert torch.equal(x_all, other_rank.design_inputs)  # type: ignore[attr-defined]  # one design for all ranks
    rows = {tuple(r) for r in x_all.tolist()}
    for index in (0, 5):
        x, y = data.batch(index)
        assert x.shape == (8, 6) and len({tuple(r) for r in x.tolist()}) == 8
        assert all(tuple(r) in rows for r in x.tolist())
        assert torch.equal(x, data.batch(index)[0])
    assert not torch.equal(data.batch(0)[0], data.batch(1)[0])
    assert not any(tuple(r) in rows for r in data.eval_batch(0)[0].tolist())  # eval: fresh draws
    aug = torch.cat([x_all.double(), torch.ones(40, 1, dtype=torch.float64)], 1)
    assert data.hessian_lambda_max == pytest.approx(  # type: ignore[attr-defined]
        float(torch.linalg.eigvalsh(2 * aug.T @ aug / 40).max()), rel=1e-9)
    full = build_data(spec, seed=0, batch_size=40)
    assert torch.equal(full.batch(3)[0], x_all)  # batch_size == num_samples: full batch, in order
    with pytest.raises(SpecError, match="training.batch_size"):
        build_data(spec, seed=0, batch_size=41)


@pytest.mark.parametrize(("k", "diverges"), [(0.9, False), (1.1, True)])
def test_full_batch_gd_on_the_fixed_design_diverges_exactly_beyond_2_over_lambda_max(k: float,
                                                                                    diverges: bool) -> None:
    from contracts.recipe import LinearModel
    from workers.models import build_model

    spec = RegressionData(dim=6, condition=10.0, noise=0.1, seed=2, fixed_design=True, num_samples=40)
    data = build_data(spec, seed=0, batch_size=40)
    model = build_model(LinearModel(), data, seed=0)
    lam = data.hessian_lambda_max  # type: ignore[attr-defined]
    opt = torch.optim.SGD(model.parameters(), lr=k * 2 / lam, momentum=0.0)
    with torch.no_grad():
        first = float(model(data.batch(0)))
    for step in range(200):
        opt.zero_grad()
        loss = model(data.batch(step))
        loss.backward()
        opt.step()
    with torch.no_grad():
        last = float(model(data.batch(0)))
    assert (not math.isfinite(last) or last > 100 * first) if diverges else last < first


def _constant_guess_loss(data: Any, batches: int) -> tuple[float, float]:
    """The training loss of the best input-free guess, measured on real batches (its mean and standard error):
    the targets' empirical frequencies (CE) or their mean (MSE), fitted on the same batches."""
    ys = [data.batch(i)[1] for i in range(batches)]
    if ys[0].dtype == torch.long:
        y = torch.cat([t.flatten() for t in ys])
        freq = torch.bincount(y, minlength=data.vocab_size).double() / y.numel()
        losses = -freq[y].log()
    else:
        y = torch.cat(ys).double()
        losses = ((y - y.mean(0, keepdim=True)) ** 2).flatten()
    return float(losses.mean()), float(losses.std()) / math.sqrt(losses.numel())


@pytest.mark.parametrize(
    ("name", "spec", "expected"),
    [
        ("markov", MarkovData(vocab_size=32, seq_len=32, branching=4), None),
        ("markov", MarkovData(vocab_size=16, seq_len=16, branching=2, seed=5), None),
        ("regression", RegressionData(dim=8, noise=0.3), 1.09),
        ("fixed design", RegressionData(dim=6, noise=0.1, seed=2, fixed_design=True, num_samples=64), None),
        ("running sum", SequenceData(task="running_sum", seq_len=12, dim=3), 1.0),
        ("copy", SequenceData(task="copy", seq_len=16, dim=4), 0.75),  # zero targets before the delay of 4
    ],
)
def test_trivial_loss_is_what_ignoring_the_inputs_scores(name: str, spec: Any, expected: float | None) -> None:
    """``trivial_loss`` (what the verdict calls learning nothing) matches the loss of the best constant guess on
    the data's own training batches, within 5 standard errors; it lies above the floor."""
    data = build_data(spec, seed=3, batch_size=32)
    assert data.trivial_loss is not None and data.loss_floor is not None
    measured, se = _constant_guess_loss(data, 60)
    assert measured == pytest.approx(data.trivial_loss, abs=5 * se + 1e-3), name
    if expected is not None:
        assert data.trivial_loss == pytest.approx(expected)
    assert data.trivial_loss > data.loss_floor
    # measured as the trainer measures a user dataset's: the built-in model's own loss (``loss_spec``) on targets
    model = build_model(TinyGPTModel(vocab_size=data.vocab_size, context=data.seq_len, d_model=16, n_layers=1)
                        if data.kind == "tokens" else RecurrentModel(hidden=8) if data.kind == "sequence"
                        else DeepMLPModel(depth=2, width=8), data, seed=0)
    targets = torch.cat([data.batch(i)[1] for i in range(60)])
    assert Objective(model).trivial_loss(targets) == pytest.approx(data.trivial_loss, abs=5 * se + 1e-3), name
