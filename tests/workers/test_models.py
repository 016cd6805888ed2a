"""Built-in models: the forward/blocks contract, learning, checkpointing, freezing, custom models by allow-list."""

from __future__ import annotations

import copy
import math
import sys
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

from contracts.recipe import (
    CustomModel,
    DeepMLPModel,
    LinearModel,
    MarkovData,
    RecurrentModel,
    RegressionData,
    SequenceData,
    TinyGPTModel,
)
from workers.data import DataSource, SpecError, build_data
from workers.models import (
    BallastModel,
    MLPBlock,
    TinyGPT,
    TransformerBlock,
    build_model,
    freeze_first_n_blocks,
    model_blocks,
    param_block_index,
    set_activation_checkpointing,
)

FIXTURES = "ballast_custom_fixtures"
GPT = TinyGPTModel(vocab_size=16, context=16, n_layers=2, n_heads=2, d_model=32)




def _markov(batch_size: int = 16) -> DataSource:
    return build_data(MarkovData(vocab_size=16, seq_len=16, branching=2), seed=0, batch_size=batch_size)


def _regression(batch_size: int = 32) -> DataSource:
    return build_data(RegressionData(dim=8, condition=4.0, noise=0.05), seed=0, batch_size=batch_size)


def _sequence(batch_size: int = 16) -> DataSource:
    return build_data(SequenceData(task="running_sum", seq_len=8, dim=3), seed=0, batch_size=batch_size)


CASES: dict[str, tuple[TinyGPTModel | DeepMLPModel | RecurrentModel | LinearModel, Callable[[], DataSource],
                       float, int]] = {
    "tiny_gpt": (GPT, _markov, 3e-3, 2),
    "tiny_gpt_post_ln_qk": (GPT.model_copy(update={"norm_position": "post", "qk_layernorm": True}), _markov, 3e-3, 2),
    "deep_mlp": (DeepMLPModel(depth=4, width=32), _regression, 1e-3, 4),
    "deep_mlp_tanh_plain": (DeepMLPModel(depth=3, width=16, activation="tanh", residual=False), _regression, 3e-3, 3),
    "rnn": (RecurrentModel(cell="rnn", hidden=16, layers=2), _sequence, 1e-2, 3),
    "lstm": (RecurrentModel(cell="lstm", hidden=16), _sequence, 1e-2, 2),
    "linear": (LinearModel(), _regression, 5e-2, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_forward_returns_scalar_loss_and_blocks(case: str) -> None:
    spec, make_data, _, n_blocks = CASES[case]
    data = make_data()
    model = build_model(spec, data, seed=0)
    loss = model(data.batch(0))
    assert isinstance(loss, Tensor) and loss.ndim == 0 and loss.dtype == torch.float32
    assert math.isfinite(loss.item())
    assert len(model_blocks(model)) == n_blocks


@pytest.mark.parametrize("case", list(CASES))
def test_loss_decreases_with_adam(case: str) -> None:
    spec, make_data, lr, _ = CASES[case]
    data = make_data()
    model = build_model(spec, data, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    losses = []
    for step in range(40):
        loss = model(data.batch(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)


def test_tiny_gpt_approaches_the_entropy_floor() -> None:
    data = _markov(batch_size=32)
    model = build_model(GPT, data, seed=0)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(60):
        loss = model(data.batch(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        held_out = sum(model(data.eval_batch(i)).item() for i in range(4)) / 4
    assert data.entropy_floor is not None
    assert held_out < data.entropy_floor + 0.35 < math.log(16)  # from log(16) = 2.77 to near the floor


def test_z_loss_adds_coefficient_times_mean_squared_logsumexp() -> None:
    data = _markov()
    plain = build_model(GPT, data, seed=1)
    with_z = build_model(GPT.model_copy(update={"z_loss": 1e-2}), data, seed=1)
    assert isinstance(with_z, TinyGPT)
    captured: list[Tensor] = []
    with_z.head.register_forward_hook(lambda _m, _i, out: captured.append(out.detach()))
    batch = data.batch(0)
    loss_z, loss_plain = with_z(batch), plain(batch)
    logits = captured[0].reshape(-1, 16)
    z = torch.logsumexp(logits, -1).pow(2).mean()
    torch.testing.assert_close(loss_z, loss_plain + 1e-2 * z)
    torch.testing.assert_close(with_z.last_metrics["ce"], loss_plain.detach())


def test_tiny_gpt_init_std_is_applied() -> None:
    model = build_model(GPT.model_copy(update={"init_std": 0.1, "d_model": 64}), seed=0)
    assert isinstance(model, TinyGPT)
    block = model.blocks[0]
    assert isinstance(block, TransformerBlock)
    w = block.attn.qkv.weight
    assert w.std().item() == pytest.approx(0.1, rel=0.05)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.1, rel=0.1)


@pytest.mark.parametrize(("activation", "gain"), [("relu", math.sqrt(2)), ("tanh", 5 / 3), ("sigmoid", 1.0)])
def test_deep_mlp_init_is_fan_in_times_scale(activation: str, gain: float) -> None:
    spec = DeepMLPModel(depth=2, width=256, activation=activation, init_scale=0.5)
    model = build_model(spec, _regression(), seed=0)
    block = model_blocks(model)[1]
    assert isinstance(block, MLPBlock)
    weight = block.linear.weight
    assert weight.std().item() == pytest.approx(gain * 0.5 / math.sqrt(256), rel=0.05)


def test_seeded_build_is_reproducible_and_leaves_the_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a = build_model(GPT, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    b = build_model(GPT, seed=7)
    c = build_model(GPT, seed=8)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(pa, pb), name
    assert isinstance(a, TinyGPT) and isinstance(c, TinyGPT)
    assert not torch.equal(a.head.weight, c.head.weight)


@pytest.mark.parametrize("case", ["tiny_gpt", "deep_mlp", "lstm"])
def test_activation_checkpointing_gives_the_same_gradients(case: str) -> None:
    spec, make_data, _, _ = CASES[case]
    data = make_data()
    plain = build_model(spec, data, seed=0)
    ckpt = copy.deepcopy(plain)
    set_activation_checkpointing(ckpt, True)
    calls = {"n": 0}

    def count(_m: nn.Module, _i: object) -> None:
        calls["n"] += 1

    # a pre-hook on the block's first layer: the block's recompute runs its own forward (not its __call__), and
    # may stop early once the saved tensors it needs exist, skipping later layers and forward hooks
    next(model_blocks(ckpt)[0].children()).register_forward_pre_hook(count)
    batch = data.batch(0)
    plain(batch).backward()
    ckpt(batch).backward()
    assert calls["n"] == 2  # the block ran again in the backward pass: checkpointing really happened
    for (name, p), (_, q) in zip(plain.named_parameters(), ckpt.named_parameters(), strict=True):
        assert p.grad is not None and q.grad is not None
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-7, msg=name)


def test_activation_checkpointing_is_refused_without_blocks() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))  # no ModuleList, no `blocks`
    with pytest.raises(SpecError, match=r"distributed.activation_checkpointing: no blocks found in Sequential"):
        set_activation_checkpointing(model, True)
    set_activation_checkpointing(model, False)  # turning it off is always fine


def test_freezing_keeps_the_first_blocks_unchanged_after_a_step() -> None:
    data = _markov()
    model = build_model(GPT, data, seed=0)
    names = freeze_first_n_blocks(model, 1)
    assert names and all(n.startswith("blocks.0.") for n in names)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    model(data.batch(0)).backward()
    opt.step()
    for name, p in model.named_parameters():
        moved = not torch.equal(p, before[name])
        assert moved == (not name.startswith("blocks.0.")), name  # embeddings and later blocks still train


def test_freezing_more_blocks_than_exist_is_refused() -> None:
    with pytest.raises(SpecError, match="freeze_first_n_blocks"):
        freeze_first_n_blocks(build_model(GPT, seed=0), 3)


def test_param_block_index_maps_parameters_to_blocks() -> None:
    model = build_model(DeepMLPModel(depth=3, width=4), _regression(), seed=0)
    index = param_block_index(model)
    assert index == {f"blocks.{i}.linear.{k}": i for i in range(3) for k in ("weight", "bias")}


@pytest.mark.parametrize(
    ("spec", "data", "message"),
    [
        (DeepMLPModel(), None, "needs the data's dimensions"),
        (LinearModel(), _markov, "needs features data"),
        (RecurrentModel(), _regression, "needs sequence data"),
        (GPT, _regression, "needs token data"),
        (GPT.model_copy(update={"vocab_size": 32}), _markov, "data.vocab_size"),
        (GPT.model_copy(update={"context": 8}), _markov, "data.seq_len"),
    ],
)
def test_mismatched_data_is_a_clear_error(spec: object, data: object, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        build_model(spec, data() if callable(data) else None)  # type: ignore[arg-type]


def test_ballast_models_are_ballast_models() -> None:
    assert isinstance(build_model(GPT), BallastModel)


# ------------------------------------------------------------------------------------------------- custom
def _custom(factory: str, **params: object) -> CustomModel:
    return CustomModel.model_validate(
        {"factory": factory, "params": params}, context={"allowed_import_modules": [FIXTURES]}
    )


@pytest.mark.usefixtures("fixtures_on_path")
@pytest.mark.parametrize("allowed", [[], ["ballast_custom"], ["other", "ballast_custom_fixtures_x"]])
def test_custom_model_refused_unless_allow_listed(allowed: list[str]) -> None:
    sys.modules.pop(FIXTURES, None)
    with pytest.raises(SpecError, match=r"model\.factory: module 'ballast_custom_fixtures' is not on"):
        build_model(_custom(f"{FIXTURES}:make_model"), allowed_import_modules=allowed)
    assert FIXTURES not in sys.modules  # refused before importing, so none of its code ran


@pytest.mark.usefixtures("fixtures_on_path")
def test_custom_model_accepted_when_allowed_and_trains() -> None:
    data = build_data(RegressionData(dim=3), seed=0, batch_size=32)
    model = build_model(_custom(f"{FIXTURES}:make_model", hidden=16), data, seed=0,
                        allowed_import_modules=[FIXTURES])
    assert len(model_blocks(model)) == 2
    assert param_block_index(model)["blocks.1.weight"] == 1
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = model(data.batch(0)).item()
    for step in range(30):
        loss = model(data.batch(step))
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert model(data.batch(0)).item() < 0.5 * first


@pytest.mark.usefixtures("fixtures_on_path")
@pytest.mark.parametrize(
    ("factory", "message"),
    [
        ("make_vector_loss_model", r"loss.name: model returned a tensor of shape \(4,\), not a scalar; add a loss"),
        ("make_bad_blocks_model", "blocks\\[1\\] must be a submodule of the model"),
        ("make_not_a_module", "must return a torch.nn.Module"),
        ("missing_function", "has no attribute"),
    ],
)
def test_custom_model_contract_violations_are_clear_errors(factory: str, message: str) -> None:
    data = build_data(RegressionData(dim=3), seed=0, batch_size=4)
    with pytest.raises(SpecError, match=message):
        build_model(_custom(f"{FIXTURES}:{factory}"), data, allowed_import_modules=[FIXTURES])


def test_custom_model_bad_import_string_is_refused() -> None:
    spec = CustomModel.model_construct(factory="not an import", params={})
    with pytest.raises(SpecError, match="is not a 'module:function' import string"):
        build_model(spec, allowed_import_modules=["not an import"])


# --------------------------------------------------------------------------------- recurrent spectral radius
@pytest.mark.parametrize("cell", ["rnn", "gru", "lstm"])
def test_recurrent_spectral_radius_sets_every_recurrent_eigenvalue_modulus(cell: str) -> None:
    from contracts.recipe import RecurrentModel, SequenceData
    from workers.data import build_data

    data = build_data(SequenceData(seq_len=8, dim=3), seed=0, batch_size=2)
    model = build_model(RecurrentModel(cell=cell, hidden=16, layers=2, recurrent_spectral_radius=1.5), data, seed=0)
    for block in model.blocks[:-1]:
        w = block.rnn.weight_hh_l0.detach()
        for gate in range(w.shape[0] // 16):
            mod = torch.linalg.eigvals(w[gate * 16:(gate + 1) * 16].double()).abs()
            torch.testing.assert_close(mod, torch.full_like(mod, 1.5), atol=1e-5, rtol=0)


def test_recurrent_spectral_radius_none_keeps_the_default_init_bit_identical() -> None:
    from contracts.recipe import RecurrentModel, SequenceData
    from workers.data import build_data

    data = build_data(SequenceData(seq_len=8, dim=3), seed=0, batch_size=2)
    default = build_model(RecurrentModel(hidden=16), data, seed=4)
    explicit = build_model(RecurrentModel(hidden=16, recurrent_spectral_radius=None), data, seed=4)
    torch.manual_seed(4)
    reference = nn.RNN(3, 16, batch_first=True)  # what the default init has always been: PyTorch's own
    for a, b in zip(default.state_dict().values(), explicit.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(default.blocks[0].rnn.weight_hh_l0, reference.weight_hh_l0)
    scaled = build_model(RecurrentModel(hidden=16, recurrent_spectral_radius=1.0), data, seed=4)
    assert torch.equal(scaled.blocks[0].rnn.weight_ih_l0, default.blocks[0].rnn.weight_ih_l0)
    assert not torch.equal(scaled.blocks[0].rnn.weight_hh_l0, default.blocks[0].rnn.weight_hh_l0)
