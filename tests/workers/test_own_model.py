"""Bring your own model, data and loss: plain PyTorch modules, Datasets and Hugging Face models, used unchanged.

Real torch and transformers throughout (small, seeded): the classifier example trains and recovers, a GPT-2 from
config trains on dict batches, a Dataset-backed run resumes bit-identically, blocks are found, the saved state
dict is the user module's own, activation checkpointing keeps gradients, no-decay groups, and clear SpecErrors.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from contracts.recipe import (
    BatchScaleFault,
    CrossEntropyLoss,
    CustomData,
    CustomLoss,
    CustomModel,
    DatasetData,
    DType,
    HFCausalLMModel,
    ModelLoss,
    MSELoss,
    Optimizer,
    Recipe,
    TinyGPTModel,
    TokensFileData,
    load_recipe,
    validate_recipe_data,
)
from contracts.wire import AttemptOutcome, AttemptSpec
from examples.classifier.model import make_classifier
from examples.hf_gpt2.data import write_tokens
from tests.recipes import recipe_doc
from tests.workers import ballast_custom_fixtures as fixtures
from workers.checkpoint import load_checkpoint
from workers.context import WorkerContext
from workers.data import DatasetSource, SeededSampler, SpecError, build_data
from workers.data import custom as custom_module
from workers.data import dataset as dataset_module
from workers.entry import run_attempt
from workers.faults import FaultInjector
from workers.models import build_model, find_blocks, model_blocks, param_block_index, set_activation_checkpointing
from workers.objective import Objective, trivial_loss
from workers.optim import apply_hyperparameters, build_optimizer, load_optimizer_state
from workers.trainer import GuardedTrainer

pytestmark = pytest.mark.usefixtures("fixtures_on_path")
transformers = pytest.importorskip("transformers")

FIX = "ballast_custom_fixtures"
ALLOWED = ["examples", FIX]
CLASSIFIER_PARAMS = {"in_features": 8, "hidden": 16, "classes": 3, "depth": 3}
BASE: dict[str, Any] = {
    "name": "own-model",
    "model": {"name": "custom", "factory": "examples.classifier.model:make_classifier", "params": CLASSIFIER_PARAMS},
    "data": {"name": "dataset", "factory": "examples.classifier.model:make_dataset",
             "params": {"n": 256, "in_features": 8, "classes": 3}},
    "loss": {"name": "cross_entropy", "label_smoothing": 0.1},
    "training": {"max_steps": 40, "batch_size": 16, "seed": 0},
    "optimizer": {"name": "adamw", "lr": 3e-3, "weight_decay": 0.05},
    "schedule": {"warmup_steps": 2},
    "checkpoint": {"every_steps": 20},
    "success": {"min_progress": 0.0, "early_min_progress": 0.0},
}
GPT2 = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 64, "n_positions": 32,
        "bos_token_id": 0, "eos_token_id": 0}


def make_recipe(base: dict[str, Any] = BASE, **sections: Any) -> Recipe:
    return validate_recipe_data(recipe_doc(base, **sections), allowed_import_modules=ALLOWED)


def run(recipe: Recipe, tmp_path: Path, **spec: Any) -> AttemptOutcome:
    spec.setdefault("checkpoint_dir", str(tmp_path / "ckpt"))
    return run_attempt(AttemptSpec(recipe=recipe, allowed_import_modules=ALLOWED, **spec))


def gpt2_recipe(tmp_path: Path, **sections: Any) -> Recipe:
    path = write_tokens(tmp_path / "tokens.npy", n_tokens=8192, vocab_size=64)
    base = recipe_doc(BASE, model={"name": "hf_causal_lm", "config": GPT2},
                      data={"name": "tokens_file", "path": str(path), "seq_len": 32},
                      training={"max_steps": 30, "batch_size": 8, "seed": 0}, optimizer={"lr": 1e-2})
    base.pop("loss")
    base["model"].pop("factory"), base["model"].pop("params")
    base["data"] = {"name": "tokens_file", "path": str(path), "seq_len": 32}
    return make_recipe(base, **sections)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


# ------------------------------------------------------------------------------------------- training
def test_unmodified_classifier_on_a_tensor_dataset_trains_with_cross_entropy(tmp_path: Path) -> None:
    res = run(make_recipe(), tmp_path)
    assert res.outcome == "succeeded", res.reason
    assert mean(res.losses[-5:]) < 0.6 * mean(res.losses[:5]), res.losses


def test_the_classifier_example_diverges_on_its_fault_and_the_retry_recovers(tmp_path: Path) -> None:
    recipe = load_recipe(Path("examples/classifier/recipe.yaml").read_text(), allowed_import_modules=ALLOWED)
    first = run(recipe, tmp_path)
    assert first.outcome == "diverged" and first.onset_step is not None and first.onset_step >= 60, first.reason
    healthy = [c for c in first.checkpoints if c.healthy and c.step <= first.onset_step]
    retry = recipe.model_copy(update={"clipping": recipe.clipping.model_copy(update={"method": "global_norm"})})
    second = run(retry, tmp_path, attempt=2, resume_from=healthy[-1].path, rewarm_steps=10)
    assert second.outcome == "succeeded", second.reason


def test_gpt2_from_config_trains_on_dict_batches_from_a_token_file(tmp_path: Path) -> None:
    recipe = gpt2_recipe(tmp_path)
    trainer = GuardedTrainer(AttemptSpec(recipe=recipe, checkpoint_dir=str(tmp_path / "c"),
                                         allowed_import_modules=ALLOWED), WorkerContext())
    assert isinstance(trainer.module, transformers.GPT2LMHeadModel)
    batch = trainer.data.batch(0)
    assert isinstance(batch, dict) and sorted(batch) == ["attention_mask", "input_ids", "labels"]
    assert len(trainer._block_members) == 2  # transformer.h, found automatically: the per-layer profile works
    res = trainer.train()
    assert res.outcome == "succeeded", res.reason
    assert mean(res.losses[-5:]) < 0.85 * mean(res.losses[:5]), res.losses


def test_a_nan_loss_on_a_hugging_face_model_is_caught_by_the_detectors(tmp_path: Path) -> None:
    recipe = gpt2_recipe(tmp_path, training={"max_steps": 12}, faults=[{"type": "nan_loss", "step": 7}])
    res = run(recipe, tmp_path)
    assert res.outcome == "diverged" and res.final_step == 7 and res.detector == "nonfinite", res.reason


def test_the_gpt2_example_recipe_catches_its_nan_loss(tmp_path: Path) -> None:
    recipe = load_recipe(Path("examples/hf_gpt2/recipe.yaml").read_text())
    path = write_tokens(tmp_path / "tokens.npy")  # what `python -m examples.hf_gpt2.data` writes
    recipe = recipe.model_copy(update={"data": recipe.data.model_copy(update={"path": str(path)}),
                                       "training": recipe.training.model_copy(update={"max_steps": 45})})
    res = run(recipe, tmp_path)
    assert res.outcome == "diverged" and res.final_step == 40 and res.detector == "nonfinite", res.reason
    assert [c.step for c in res.checkpoints if c.healthy] == [25]


# ------------------------------------------------------------------------------------------- resume
def _final_weights(res: AttemptOutcome) -> dict[str, Tensor]:
    state, _ = load_checkpoint(res.checkpoints[-1].path, keys=["model"])
    return state["model"]  # type: ignore[no-any-return]


def test_resume_with_a_dataset_source_is_bit_identical(tmp_path: Path) -> None:
    recipe = make_recipe(training={"max_steps": 40, "batch_size": 16, "grad_accum_steps": 2, "deterministic": True,
                                   "seed": 3})
    straight = run(recipe, tmp_path / "straight")
    assert straight.outcome == "succeeded" and len(straight.losses) == 40
    half = next(c for c in straight.checkpoints if c.step == 20)
    resumed = run(recipe, tmp_path / "resumed", resume_from=half.path)
    assert resumed.start_step == 20 and resumed.losses == straight.losses[20:]
    a, b = _final_weights(straight), _final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_of_a_hugging_face_model_with_dropout_is_bit_identical(tmp_path: Path) -> None:
    recipe = gpt2_recipe(tmp_path, training={"max_steps": 10, "deterministic": True}, checkpoint={"every_steps": 5})
    straight = run(recipe, tmp_path / "straight")
    resumed = run(recipe, tmp_path / "resumed", resume_from=next(c for c in straight.checkpoints if c.step == 5).path)
    assert resumed.losses == straight.losses[5:]  # the dropout masks too: the RNG is part of the checkpoint
    a, b = _final_weights(straight), _final_weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------------------- blocks
class Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.lin(x)
        return out


class Discoverable(nn.Module):
    def __init__(self, own: bool = False) -> None:
        super().__init__()
        self.short = nn.ModuleList([Layer(), Layer()])
        self.mixed = nn.ModuleList([Layer(), nn.ReLU(), Layer(), nn.ReLU(), Layer()])  # not one type: skipped
        self.enc = nn.Module()
        self.enc.layers = nn.ModuleList([Layer() for _ in range(3)])
        self.tie = nn.ModuleList([Layer() for _ in range(3)])  # as long as enc.layers, but later in module order
        if own:
            self.blocks = [self.short[1], self.short[0]]


@pytest.mark.parametrize(
    ("own", "path", "expected"),
    [
        (True, None, ["short.1", "short.0"]),  # model.blocks wins, in its own order
        (True, "tie", ["short.1", "short.0"]),
        (False, "short", ["short.0", "short.1"]),  # the recipe's attribute path
        (False, None, ["enc.layers.0", "enc.layers.1", "enc.layers.2"]),  # longest uniform ModuleList, first on ties
    ],
)
def test_blocks_are_found_by_attribute_path_or_longest_module_list(own: bool, path: str | None,
                                                                   expected: list[str]) -> None:
    model = Discoverable(own)
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(b)] for b in find_blocks(model, path)] == expected


def test_a_model_without_blocks_trains_but_cannot_freeze(tmp_path: Path) -> None:
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []
    base = recipe_doc(BASE, model={"factory": f"{FIX}:make_mlp", "params": {"dim": 3}},
                      data={"factory": f"{FIX}:make_regression_dataset", "params": {}}, training={"max_steps": 5})
    base["loss"] = {"name": "mse"}
    recipe = make_recipe(base)
    res = run(recipe, tmp_path / "a")
    assert res.outcome == "succeeded" and len(res.losses) == 5
    frozen = recipe.model_copy(update={"distributed": recipe.distributed.model_copy(
        update={"freeze_first_n_blocks": 1})})
    with pytest.raises(SpecError, match=r"^distributed.freeze_first_n_blocks: no blocks found in Sequential"):
        GuardedTrainer(AttemptSpec(recipe=frozen, checkpoint_dir=str(tmp_path / "b"),
                                   allowed_import_modules=ALLOWED), WorkerContext())


@pytest.mark.parametrize(("path", "message"), [("nope", "has no submodule 'nope'"),
                                               ("enc", "'enc' is a Module, not a non-empty ModuleList")])
def test_a_bad_blocks_path_names_the_field(path: str, message: str) -> None:
    with pytest.raises(SpecError, match=f"^model.blocks: .*{message}"):
        find_blocks(Discoverable(), path)


def test_pretrained_path_loads_local_weights_without_a_download(tmp_path: Path) -> None:
    saved = build_model(HFCausalLMModel(config=GPT2), seed=3)
    saved.save_pretrained(tmp_path / "gpt2")  # type: ignore[operator]
    loaded = build_model(HFCausalLMModel(pretrained_path=str(tmp_path / "gpt2")), seed=0)
    assert loaded.training and all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(),
                                                                     loaded.state_dict().values(), strict=True))
    with pytest.raises(SpecError, match=r"^model.pretrained_path: cannot load a causal LM from"):
        build_model(HFCausalLMModel(pretrained_path=str(tmp_path / "missing")))


def test_gpt2_blocks_are_transformer_h() -> None:
    model = build_model(HFCausalLMModel(config=GPT2), seed=0)
    assert model_blocks(model) == list(model.transformer.h)  # type: ignore[union-attr,arg-type]
    assert set(param_block_index(model).values()) == {0, 1}


# ------------------------------------------------------------------------------------ state dict keys
@pytest.mark.parametrize("kind", ["classifier", "gpt2"])
def test_the_saved_model_is_the_user_modules_own_state_dict(tmp_path: Path, kind: str) -> None:
    distributed = {"activation_checkpointing": True, "freeze_first_n_blocks": 1}
    if kind == "classifier":
        recipe = make_recipe(training={"max_steps": 4}, distributed=distributed)
        fresh = make_classifier(**CLASSIFIER_PARAMS)
    else:
        recipe = gpt2_recipe(tmp_path, training={"max_steps": 4}, distributed=distributed)
        fresh = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**GPT2))
    res = run(recipe, tmp_path)
    assert res.outcome == "succeeded", res.reason
    saved = _final_weights(res)
    assert list(saved) == list(fresh.state_dict())  # no wrapper prefix, no duplicated or extra keys
    fresh.load_state_dict(saved, strict=True)


# ---------------------------------------------------------------------------------- activation ckpt
def _grads(model: nn.Module, objective: Objective, batch: Any) -> dict[str, Tensor]:
    torch.manual_seed(0)  # the same dropout masks in both runs (checkpointing replays the RNG in the recompute)
    model.zero_grad()
    objective.loss(batch, model=model).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("kind", ["classifier", "gpt2"])
def test_activation_checkpointing_on_a_custom_model_keeps_the_gradients(tmp_path: Path, kind: str) -> None:
    if kind == "classifier":
        recipe = make_recipe()
    else:
        recipe = gpt2_recipe(tmp_path)
    data = build_data(recipe.data, seed=0, batch_size=8, allowed_import_modules=ALLOWED)
    plain = build_model(recipe.model, data, seed=0, allowed_import_modules=ALLOWED, loss=recipe.loss)
    ckpt = copy.deepcopy(plain)
    set_activation_checkpointing(ckpt, True)
    keys = list(plain.state_dict())
    calls = {"n": 0}
    next(model_blocks(ckpt)[0].children()).register_forward_pre_hook(lambda _m, _i: calls.__setitem__("n",
                                                                                                      calls["n"] + 1))
    batch = data.batch(0)
    g_plain = _grads(plain, Objective(plain, recipe.loss), batch)
    g_ckpt = _grads(ckpt, Objective(ckpt, recipe.loss), batch)
    assert calls["n"] == 2  # the block's layers ran again in the backward pass
    assert g_plain.keys() == g_ckpt.keys() and len(g_plain) == len(list(plain.parameters()))
    for name in g_plain:
        torch.testing.assert_close(g_ckpt[name], g_plain[name], rtol=0, atol=1e-7, msg=name)
    assert list(ckpt.state_dict()) == keys
    set_activation_checkpointing(ckpt, False)
    assert all("forward" not in b.__dict__ for b in model_blocks(ckpt))


# ------------------------------------------------------------------------------------- param groups
def test_biases_and_norm_weights_get_no_weight_decay() -> None:
    model = make_classifier(**CLASSIFIER_PARAMS)
    named = list(model.named_parameters())
    opt = build_optimizer(named, Optimizer(weight_decay=0.1), model)
    by_id = {id(p): n for n, p in named}
    decay, keep = ([by_id[id(p)] for p in g["params"]] for g in opt.param_groups)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert decay == ["stem.weight", "layers.0.1.weight", "layers.1.1.weight", "layers.2.1.weight", "head.weight"]
    assert all(n.endswith(".bias") or ".0." in n for n in keep) and len(decay) + len(keep) == len(named)
    everything = build_optimizer(named, Optimizer(weight_decay=0.1, no_decay=[]), model)
    assert len(everything.param_groups) == 1
    apply_hyperparameters(opt, {"weight_decay": 0.5})  # a resume re-applies the recipe: the no-decay group stays 0
    assert [g["weight_decay"] for g in opt.param_groups] == [0.5, 0.0]


def test_a_one_group_optimizer_state_is_regrouped_on_resume() -> None:
    model = make_classifier(**CLASSIFIER_PARAMS)
    params = list(model.parameters())
    old = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
    model(torch.randn(4, 8)).sum().backward()
    old.step()
    new = build_optimizer(list(model.named_parameters()), Optimizer(weight_decay=0.1), model)
    load_optimizer_state(new, old.state_dict(), params)
    for p in params:
        assert torch.equal(new.state[p]["exp_avg"], old.state[p]["exp_avg"])
    assert [g["weight_decay"] for g in new.param_groups] == [0.1, 0.0]


# ------------------------------------------------------------------------------------------ objective
def test_the_call_convention_and_the_losses() -> None:
    model = make_classifier(**CLASSIFIER_PARAMS)
    x, y = torch.randn(6, 8), torch.randint(3, (6,))
    ce = Objective(model, CrossEntropyLoss(label_smoothing=0.1)).loss((x, y))
    torch.testing.assert_close(ce, F.cross_entropy(model(x), y, label_smoothing=0.1), rtol=0, atol=0)
    kw = build_model(CustomModel.model_validate({"factory": f"{FIX}:make_keyword_classifier"},
                                                context={"allowed_import_modules": ALLOWED}),
                     allowed_import_modules=ALLOWED)
    batch = {"x": x[:, :3], "labels": y % 2}
    torch.testing.assert_close(Objective(kw, CrossEntropyLoss()).loss(batch), F.cross_entropy(kw(x[:, :3]), y % 2))
    mse = Objective(model, MSELoss()).loss((x, torch.zeros(6, 3)))
    torch.testing.assert_close(mse, model(x).pow(2).mean())
    custom = Objective(model, CustomLoss.model_validate({"function": f"{FIX}:l1_loss"},
                                                        context={"allowed_import_modules": ALLOWED}),
                       allowed_import_modules=ALLOWED)
    torch.testing.assert_close(custom.loss((x, torch.zeros(6, 3))), model(x).abs().mean())
    gpt = build_model(HFCausalLMModel(config=GPT2), seed=0)
    ids = torch.randint(64, (2, 8))
    hf_batch = {"input_ids": ids, "labels": ids}
    gpt.eval()
    own = Objective(gpt, ModelLoss()).loss(hf_batch)
    torch.testing.assert_close(own, gpt(**hf_batch).loss)
    bf16 = Objective(model, CrossEntropyLoss(), dtype=DType.bf16, device=torch.device("cpu")).loss((x, y))
    assert bf16.dtype == torch.float32 and bf16.ndim == 0


def _constant_loss(spec: Any, guess: Tensor, targets: Tensor) -> float:
    """The real loss (``Objective.loss_from``) of predicting ``guess`` for every sample, whatever its inputs."""
    outputs = guess.expand(targets.shape[0], *guess.shape).clone()
    return float(Objective(nn.Identity(), spec).loss_from(outputs, (torch.empty(0), targets)))


@pytest.mark.parametrize(
    ("spec", "targets", "classes"),
    [
        (MSELoss(), torch.randn(500, 1, generator=torch.Generator().manual_seed(1)) * 2 + 3, None),
        (MSELoss(), torch.randn(400, 5, 3, generator=torch.Generator().manual_seed(2)) + torch.arange(3.0), None),
        (CrossEntropyLoss(), torch.multinomial(torch.tensor([0.6, 0.3, 0.1]), 600, replacement=True,
                                               generator=torch.Generator().manual_seed(3)), 3),
        (CrossEntropyLoss(label_smoothing=0.2), torch.multinomial(torch.tensor([0.7, 0.2, 0.1]), 600,
                                                                  replacement=True,
                                                                  generator=torch.Generator().manual_seed(4)), 5),
        (CrossEntropyLoss(ignore_index=-1), torch.tensor([0, 0, 1, -1, -1, -1, 0, 2, -1]), 3),
        (CrossEntropyLoss(label_smoothing=0.1), torch.softmax(torch.randn(300, 4, generator=torch.Generator()
                                                                          .manual_seed(5)), -1), 4),
    ],
    ids=["mse", "mse per position", "ce", "ce smoothed, unseen classes", "ce ignore_index", "ce soft targets"],
)
def test_trivial_loss_is_the_real_loss_of_the_best_constant_guess(spec: Any, targets: Tensor,
                                                                  classes: int | None) -> None:
    """``trivial_loss`` equals the loss the objective itself computes for the best input-free guess (the targets'
    per-position mean; the log of the label-smoothed frequencies), and no nearby constant guess does better."""
    value = trivial_loss(spec, targets, classes=classes)
    assert value is not None
    if isinstance(spec, MSELoss):
        best = targets.double().mean(0).float()
    else:
        dist = (targets.double().mean(0) if targets.is_floating_point() else
                torch.bincount(targets[targets != spec.ignore_index], minlength=classes).double())
        q = (1 - spec.label_smoothing) * dist / dist.sum() + spec.label_smoothing / classes
        best = q.log().float()
    assert _constant_loss(spec, best, targets) == pytest.approx(value, rel=1e-5)
    g = torch.Generator().manual_seed(9)
    for _ in range(5):
        assert _constant_loss(spec, best + 0.05 * torch.randn(best.shape, generator=g), targets) > value


def test_trivial_loss_is_unknown_where_it_cannot_be_worked_out() -> None:
    labels = torch.tensor([0, 1, 1, 2])
    l1 = CustomLoss.model_validate({"function": f"{FIX}:l1_loss"}, context={"allowed_import_modules": ALLOWED})
    assert trivial_loss(l1, torch.randn(8, 1)) is None  # a user's loss
    assert trivial_loss(ModelLoss(), labels) is None  # a model's own loss (a built-in names its: loss_spec)
    assert trivial_loss(CrossEntropyLoss(label_smoothing=0.1), labels) is None  # smoothing needs the logits' size
    assert trivial_loss(CrossEntropyLoss(), labels, classes=2) is None  # a label beyond the logits
    assert trivial_loss(MSELoss(), torch.randn(1, 3)) is None  # one sample
    kw = build_model(_custom(f"{FIX}:make_keyword_classifier"), allowed_import_modules=ALLOWED)
    assert Objective(kw, ModelLoss()).trivial_loss(labels) is None  # a model's own loss Ballast cannot name
    assert Objective(build_model(TinyGPTModel(z_loss=1e-4), seed=0)).trivial_loss(labels) is None  # CE + z-loss


def test_your_datasets_training_targets_are_read_once_the_same_on_every_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    """A TensorDataset's training targets are the training split's (the held-out items left out), the same on
    every rank; another dataset's are read item by item, all of them up to ``TARGETS_READ_LIMIT`` items and a
    seeded sample of that many beyond it, the same on every rank."""
    spec = DatasetData.model_validate({"factory": f"{FIX}:make_regression_dataset", "eval_fraction": 0.25},
                                      context={"allowed_import_modules": ALLOWED})
    ranks = [build_data(spec, seed=0, batch_size=4, rank=r, world_size=2, allowed_import_modules=ALLOWED)
             for r in (0, 1)]
    ys = [r.training_targets() for r in ranks]
    assert ys[0] is not None and ys[1] is not None and torch.equal(ys[0], ys[1])
    source = ranks[0]
    assert isinstance(source, DatasetSource) and source.eval_set is not None
    held_out = {float(source.eval_set[i][1]) for i in range(len(source.eval_set))}  # type: ignore[arg-type]
    assert len(ys[0]) == 96 and not held_out & {float(v) for v in ys[0]}
    dicts = _dataset(f"{FIX}:make_dict_dataset", eval_fraction=0.0)
    assert torch.equal(dicts.training_targets(), fixtures.make_dict_dataset().y)  # type: ignore[arg-type]
    monkeypatch.setattr(dataset_module, "TARGETS_READ_LIMIT", 40)  # 64 items, read one by one: beyond the limit
    dict_spec = DatasetData.model_validate({"factory": f"{FIX}:make_dict_dataset", "eval_fraction": 0.0},
                                           context={"allowed_import_modules": ALLOWED})
    samples = [build_data(dict_spec, seed=0, batch_size=4, rank=r, world_size=2,
                          allowed_import_modules=ALLOWED).training_targets() for r in (0, 1)]
    assert samples[0] is not None and samples[1] is not None and torch.equal(samples[0], samples[1])
    rows = dataset_module.trivial_loss_rows(64, 40, seed=0)
    assert len(set(rows)) == 40 and torch.equal(samples[0], fixtures.make_dict_dataset().y[rows])
    assert torch.equal(source.training_targets(), ys[0])  # type: ignore[arg-type]  # a TensorDataset's at once
    monkeypatch.setattr(dataset_module, "TARGET_VALUES_LIMIT", 40)  # past it, a seeded sample of rows
    sampled = [r.training_targets() for r in ranks]
    assert sampled[0] is not None and sampled[1] is not None and torch.equal(sampled[0], sampled[1])
    assert len(sampled[0]) == 40 and {float(v) for v in sampled[0]} <= {float(v) for v in ys[0]}


def _custom(factory: str) -> CustomModel:
    return CustomModel.model_validate({"factory": factory}, context={"allowed_import_modules": ALLOWED})


def _dataset(factory: str, **kw: Any) -> DatasetSource:
    spec = DatasetData.model_validate({"factory": factory, **kw}, context={"allowed_import_modules": ALLOWED})
    source = build_data(spec, seed=0, batch_size=4, allowed_import_modules=ALLOWED)
    assert isinstance(source, DatasetSource)
    return source


@pytest.mark.parametrize(
    ("model", "data", "loss", "message"),
    [
        ("make_keyword_classifier", "make_dict_dataset", ModelLoss(),
         r"^loss.name: model returned a tensor of shape \(4, 2\), not a scalar; add a loss: section"),
        ("make_keyword_classifier", "make_dict_dataset", MSELoss(),
         r"^loss.name: mse needs outputs and targets of one shape, got \(4, 2\) and \(4,\)"),
        ("make_mlp", "make_regression_dataset", ModelLoss(),
         r"^model.factory: model\(\(inputs, targets\)\) failed on a data batch: .*add a loss: section"),
        ("make_mlp", "make_regression_dataset", CrossEntropyLoss(),
         r"^loss.name: cross_entropy needs logits \[..., C\] and integer targets"),
        ("make_mlp", "make_regression_dataset", "per_sample_loss", r"^loss.function: must return a scalar"),
    ],
)
def test_contract_violations_are_spec_errors_naming_the_field(model: str, data: str, loss: Any,
                                                              message: str) -> None:
    if isinstance(loss, str):
        loss = CustomLoss.model_validate({"function": f"{FIX}:{loss}"}, context={"allowed_import_modules": ALLOWED})
    with pytest.raises(SpecError, match=message):
        build_model(_custom(f"{FIX}:{model}"), _dataset(f"{FIX}:{data}"), allowed_import_modules=ALLOWED, loss=loss)


@pytest.mark.parametrize(("factory", "message"), [
    ("make_triples", r"^data.factory: dataset items must be \(inputs, targets\) pairs or dicts of tensors, got a 3"),
    ("make_model", r"^data.factory: must return a map-style torch.utils.data.Dataset"),
])
def test_bad_datasets_are_spec_errors(factory: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        _dataset(f"{FIX}:{factory}")


def test_missing_transformers_is_a_clear_spec_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when it is absent
    with pytest.raises(SpecError, match=r"^model.name: needs the optional 'transformers' package"):
        build_model(HFCausalLMModel(config=GPT2))


def test_token_ids_beyond_the_model_vocabulary_are_refused(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.npy", n_tokens=4096, vocab_size=128)
    data = build_data(TokensFileData(path=str(path), seq_len=16), seed=0, batch_size=2)
    with pytest.raises(SpecError, match=r"^data.vocab_size: the data's token ids reach 12\d, beyond"):
        build_model(HFCausalLMModel(config=GPT2), data)


# -------------------------------------------------------------------------------------------- sampler
def test_the_sampler_is_a_pure_function_covering_each_epoch_once_across_ranks() -> None:
    n, world, bsz = 10, 2, 3
    samplers = [SeededSampler(n, seed=4, rank=r, world_size=world, batch_size=bsz) for r in range(world)]
    order = [i for index in range(5) for s in samplers for i in s.indices(index)]  # global positions 0..29
    for epoch in range(3):
        assert sorted(order[epoch * n:(epoch + 1) * n]) == list(range(n))
    assert order[:n] != order[n:2 * n]  # a fresh permutation per epoch
    again = SeededSampler(n, seed=4, rank=1, world_size=world, batch_size=bsz)
    assert again.indices(4) == samplers[1].indices(4) and again.indices(0) == samplers[1].indices(0)


def test_held_out_items_are_disjoint_from_training_items() -> None:
    source = _dataset(f"{FIX}:make_regression_dataset", eval_fraction=0.25)

    def key(batch: Any) -> set[tuple[float, ...]]:
        return {tuple(row.tolist()) for row in batch[0]}

    train = set().union(*(key(source.batch(i)) for i in range(40)))
    held = set().union(*(key(source.eval_batch(i)) for i in range(10)))
    assert len(train) == 96 and len(held) == 32 and not train & held


def test_dict_items_collate_to_dict_batches() -> None:
    batch = _dataset(f"{FIX}:make_dict_dataset").batch(0)
    assert isinstance(batch, dict) and batch["x"].shape == (4, 3) and batch["labels"].dtype == torch.int64


# ----------------------------------------------------------------------------------------- tokens file
@pytest.mark.parametrize("suffix", [".npy", ".bin", ".pt"])
def test_token_files_in_every_format_give_the_same_batches(tmp_path: Path, suffix: str) -> None:
    tokens = np.arange(1000, dtype=np.uint16)  # token value = position: windows start at multiples of 10
    path = tmp_path / f"t{suffix}"
    if suffix == ".npy":
        np.save(path, tokens)
    elif suffix == ".bin":
        tokens.tofile(path)
    else:
        torch.save(torch.from_numpy(tokens.astype(np.int32)), path)
    source = build_data(TokensFileData(path=str(path), seq_len=10, eval_fraction=0.1), seed=0, batch_size=4)
    assert source.vocab_size == 1000 and source.kind == "tokens" and source.tokens_per_batch == 40
    batch = source.batch(3)
    assert isinstance(batch, dict) and torch.equal(batch["labels"], batch["input_ids"])
    starts = {int(row[0]) for i in range(30) for row in source.batch(i)["input_ids"]}  # type: ignore[call-overload]
    assert all(int(w[0]) % 10 == 0 for w in source.batch(3)["input_ids"])  # type: ignore[call-overload]
    held = {int(row[0]) for row in source.eval_batch(0)["input_ids"]}  # type: ignore[call-overload]
    assert starts <= set(range(0, 900, 10)) and held <= set(range(900, 1000, 10)) and held  # the tail is held out


def test_a_text_file_with_a_local_tokenizer(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    words = ["the", "cat", "sat", "on", "mat"]
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, **{w: i + 1 for i, w in enumerate(words)}},
                                                           unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    text = tmp_path / "corpus.txt"
    text.write_text(" ".join(words[i % 5] for i in range(400)))
    source = build_data(TokensFileData(path=str(text), seq_len=8, tokenizer_path=str(tmp_path / "tok")),
                        seed=0, batch_size=2)
    assert source.vocab_size == 6
    ids = source.batch(0)["input_ids"]  # type: ignore[call-overload]
    assert ids.shape == (2, 8) and set(ids.flatten().tolist()) <= {1, 2, 3, 4, 5}


# ---------------------------------------------------------------------------------------------- faults
def test_batch_faults_on_dict_batches() -> None:
    inj = FaultInjector([BatchScaleFault(step=0, factor=10.0)], attempt=1, rank=0)
    batch = {"x": torch.ones(2, 3), "labels": torch.ones(2)}
    out = inj.on_batch(0, batch)
    assert isinstance(out, dict) and torch.equal(out["x"], torch.full((2, 3), 10.0))
    assert torch.equal(out["labels"], torch.ones(2))
    assert float(inj.on_loss(0, torch.tensor(1.5), out)) == 1.5  # float inputs: scaled there, not in the loss
    tokens = {"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": torch.ones(2, 4, dtype=torch.long)}
    assert inj.on_batch(0, tokens) is tokens  # nothing to scale: the loss is scaled instead
    assert float(inj.on_loss(0, torch.tensor(1.5), tokens)) == 15.0


# ------------------------------------------------------------------------------------------------ LoRA
@pytest.mark.parametrize("kind", ["classifier", "gpt2"])
def test_lora_trains_only_the_adapters(tmp_path: Path, kind: str) -> None:
    pytest.importorskip("peft")
    if kind == "classifier":
        recipe = make_recipe(training={"max_steps": 6}, distributed={"lora": {"r": 2, "target_modules": ["1"]}})
    else:
        recipe = gpt2_recipe(tmp_path, training={"max_steps": 6}, distributed={"lora": {"r": 2,
                                                                                        "target_modules": ["c_attn"]}})
    trainer = GuardedTrainer(AttemptSpec(recipe=recipe, checkpoint_dir=str(tmp_path / "c"),
                                         allowed_import_modules=ALLOWED), WorkerContext())
    names = [n for n, _ in trainer.named_params]
    assert names and all("lora_" in n for n in names)
    before = {n: p.detach().clone() for n, p in trainer.module.named_parameters()}
    res = trainer.train()
    assert res.outcome == "succeeded", res.reason
    for n, p in trainer.module.named_parameters():
        assert torch.equal(p, before[n]) == ("lora_B" not in n and "lora_A" not in n), n
    assert list(_final_weights(res)) == list(trainer.module.state_dict())


def test_lora_without_matching_layers_names_the_field(tmp_path: Path) -> None:
    pytest.importorskip("peft")
    recipe = make_recipe(distributed={"lora": {"target_modules": ["nothing_here"]}})
    with pytest.raises(SpecError, match=r"^distributed.lora.target_modules: no layer of Classifier is named"):
        GuardedTrainer(AttemptSpec(recipe=recipe, checkpoint_dir=str(tmp_path / "c"), allowed_import_modules=ALLOWED),
                       WorkerContext())


# ------------------------------------------------------------------------------------------------- DDP
@pytest.mark.slow  # two spawned gloo ranks, like test_engine's DDP test
def test_ddp_on_dict_batches_with_powersgd_resumes_exactly(tmp_path: Path) -> None:
    import subprocess

    tokens = write_tokens(tmp_path / "tokens.npy", n_tokens=4096, vocab_size=64)
    script = Path(__file__).with_name("ddp_own_model_script.py")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path), str(tokens)], capture_output=True,
                          text=True, timeout=280, cwd=root, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads((tmp_path / "results0.json").read_text())
    straight, resumed = out["straight"], out["resumed"]
    assert straight["outcome"] == resumed["outcome"] == "succeeded" and resumed["start_step"] == 8
    assert resumed["losses"] == straight["losses"][8:]  # priming ran the dict batch through DDP(**batch)
    assert out["classifier"]["outcome"] == "succeeded" and len(out["classifier"]["losses"]) == 10


def test_on_your_data_progress_is_measured_toward_what_ignoring_the_inputs_scores(tmp_path: Path) -> None:
    """A user dataset has no known floor (the floor rules are off), so the progress rules measure the way toward
    what ignoring the inputs scores, measured on its targets; a recipe that knows its data's floor
    (``success.loss_floor``) gives one; with a custom loss neither is known and the way is toward 0. Shown by an LR
    far too small to learn: stopped at the early check each time, its reason naming the way it measured."""
    never = {"optimizer": {"lr": 1e-9}, "success": {"min_progress": 0.25, "early_min_progress": 0.05}}
    trivial = run(make_recipe(**never), tmp_path / "trivial")
    assert trivial.detector == "never_learned", trivial.reason
    assert "of the way from the initial" in trivial.reason and "to what ignoring the inputs scores, " in trivial.reason
    given = run(make_recipe(**{**never, "success": {**never["success"], "loss_floor": 0.3}}), tmp_path / "given")
    assert given.detector == "never_learned" and "to the floor 0.3 " in given.reason, given.reason
    custom = make_recipe({**BASE, "loss": {"name": "custom", "function": f"{FIX}:l1_loss"}}, **never,
                         model={"factory": f"{FIX}:make_mlp", "params": {}},
                         data={"factory": f"{FIX}:make_regression_dataset", "params": {}})
    unknown = run(custom, tmp_path / "unknown")
    assert unknown.detector == "never_learned" and "to its floor" in unknown.reason, unknown.reason


def test_a_hard_task_on_your_data_that_beats_ignoring_the_inputs_has_learned(tmp_path: Path) -> None:
    """Noisy labels (``Bernoulli(sigmoid(x @ w))``, a weak ``w``): a healthy classifier ends near 0.6 nats from a
    coin toss's 0.69, under a quarter of the way to 0. Measured toward 0, as when no floor is known, it was called
    never learned; it beats what ignoring the inputs scores by far more than the batch noise, and it is healthy."""
    recipe = make_recipe(
        model={"params": {"in_features": 16, "hidden": 32, "classes": 2, "depth": 2}},
        data={"factory": f"{FIX}:make_noisy_labels", "params": {}, "eval_fraction": 0.0},
        loss={"name": "cross_entropy"}, training={"max_steps": 150, "batch_size": 64, "seed": 0},
        success={"min_progress": 0.25, "early_min_progress": 0.05},
    )
    res = run(recipe, tmp_path)
    assert res.outcome == "succeeded", res.reason
    final = mean(res.losses[-20:])
    assert 0.75 * math.log(2) < final < 0.95 * math.log(2)  # short of a quarter of the way to 0, below a coin


def test_on_your_data_a_model_no_better_than_ignoring_its_inputs_has_never_learned(tmp_path: Path) -> None:
    """With no floor known, progress is measured toward 0, so a fall that only learns what ignoring the inputs
    scores looked like learning. The trivial loss is now measured on the training targets: labels drawn
    independently of the features (90% one class) leave a healthy classifier nothing but their frequencies, whose
    label-smoothed entropy (~0.40 nats) is two thirds of the initial ~0.6: by progress it learned, by the trivial
    loss it did not. The same classifier and loss on the example's labels, which depend on the features, ends
    healthy."""
    bars = {"min_progress": 0.25, "early_min_progress": 0.05}
    unrelated = make_recipe(
        model={"params": {"in_features": 8, "hidden": 16, "classes": 2, "depth": 2}},
        data={"factory": f"{FIX}:make_unrelated_labels", "params": {}, "eval_fraction": 0.0},
        loss={"name": "cross_entropy"}, training={"max_steps": 80, "batch_size": 32, "seed": 0}, success=bars,
    )
    res = run(unrelated, tmp_path / "unrelated")
    smoothing = unrelated.loss.label_smoothing  # the classifier example's 0.1: the targets are smoothed frequencies
    q = (1 - smoothing) * float(fixtures.make_unrelated_labels().tensors[1].double().mean()) + smoothing / 2
    entropy = -(q * math.log(q) + (1 - q) * math.log(1 - q))
    assert res.detector == "never_learned", res.reason
    assert f"no better than {entropy:.4g}," in res.reason and "ignores the inputs" in res.reason, res.reason
    healthy = run(make_recipe(success=bars), tmp_path / "learnable")
    assert healthy.outcome == "succeeded", healthy.reason


def test_a_blown_up_start_on_your_data_that_never_beats_the_mean_has_never_learned(tmp_path: Path) -> None:
    """``test_engine``'s blown-up GELU MLP (its loss falls from ~1e6 to ~3e4, 97% of the way to 0, and stays far
    above the ~1 of predicting the mean) on a user's TensorDataset instead of the built-in regression data: the
    built-in model's own loss is MSE (``loss_spec``), the targets' variance is measured, and the verdict is the one
    the built-in data gets."""
    base = {**BASE, "model": {"name": "deep_mlp", "depth": 8, "width": 64, "activation": "gelu", "init_scale": 2.0}}
    base.pop("loss")
    recipe = make_recipe(
        base, data={"factory": f"{FIX}:make_linear_targets", "params": {}, "eval_fraction": 0.0},
        training={"max_steps": 100, "batch_size": 16, "seed": 7},
        optimizer={"name": "sgd", "lr": 0.0004, "momentum": 0.9, "weight_decay": 0.0},
        clipping={"method": "global_norm", "max_norm": 1.0}, schedule={"warmup_steps": 30, "decay": "cosine"},
        success={"min_progress": 0.25, "early_min_progress": 0.05},
    )
    res = run(recipe, tmp_path)
    variance = float(fixtures.make_linear_targets().tensors[1].double().var(correction=0))
    assert res.detector == "never_learned", res.reason
    assert f"no better than {variance:.4g}," in res.reason, res.reason


def test_a_language_model_that_learns_only_the_token_frequencies_has_never_learned(tmp_path: Path) -> None:
    """A Hugging Face causal LM's own loss is cross-entropy over its labels, so on a token file the trivial loss is
    the entropy of the token frequencies: a model that predicts only those has learned nothing from the context
    (a collapse a large vocabulary hid: the fall from ln V to it can cover a quarter of the way to 0). Tokens drawn
    independently of one another (Zipf-like frequencies) leave GPT-2 nothing else to learn: never learned. The
    example's Markov tokens, whose successors depend on the context, end healthy under the same bars."""
    rng = np.random.default_rng(3)
    freqs = 1.0 / np.arange(1, 65) ** 1.1
    path = tmp_path / "iid.npy"
    np.save(path, rng.choice(64, size=16384, p=freqs / freqs.sum()).astype(np.uint16))
    bars = {"min_progress": 0.25, "early_min_progress": 0.05}
    iid = run(gpt2_recipe(tmp_path, data={"path": str(path)}, training={"max_steps": 60}, success=bars),
              tmp_path / "iid")
    assert iid.detector == "never_learned" and "ignores the inputs" in iid.reason, iid.reason
    markov = run(gpt2_recipe(tmp_path, training={"max_steps": 60}, success=bars), tmp_path / "markov")
    assert markov.outcome == "succeeded", markov.reason


def test_a_token_files_training_targets_are_its_training_windows_or_a_seeded_sample(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """All the training windows' labels (the held-out tail left out), or, past ``TARGETS_READ_LIMIT`` windows, a
    seeded sample of that many: the same on every rank, with the file's token frequencies."""
    path = write_tokens(tmp_path / "tokens.npy", n_tokens=4096, vocab_size=64)
    spec = TokensFileData(path=str(path), seq_len=16, eval_fraction=0.25)
    whole = build_data(spec, seed=0, batch_size=4).training_targets()
    tokens = torch.as_tensor(np.load(path).astype(np.int64))
    assert whole is not None and torch.equal(whole, tokens[: 192 * 16].reshape(192, 16))  # 256 windows, 64 held out
    monkeypatch.setattr(dataset_module, "TARGETS_READ_LIMIT", 50)
    ranks = [build_data(spec, seed=0, batch_size=4, rank=r, world_size=2).training_targets() for r in (0, 1)]
    assert ranks[0] is not None and ranks[1] is not None and torch.equal(ranks[0], ranks[1])
    assert ranks[0].shape == (50, 16) and {tuple(row) for row in ranks[0].tolist()} <= set(map(tuple, whole.tolist()))
    gpt = build_model(HFCausalLMModel(config=GPT2), seed=0)
    measured, exact = Objective(gpt, ModelLoss()).trivial_loss(ranks[0]), trivial_loss(CrossEntropyLoss(), whole)
    assert measured is not None and exact is not None and measured == pytest.approx(exact, abs=0.1)


def test_a_custom_factorys_training_targets_are_rank_zeros_first_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``custom`` factory's batches are per rank: every rank reads rank 0's first training batches (the factory
    called with rank 0's seed), so all measure the same targets, up to ``TARGETS_READ_LIMIT`` rows or
    ``TARGET_BATCHES_LIMIT`` batches."""
    spec = CustomData.model_validate({"factory": f"{FIX}:make_batch"}, context={"allowed_import_modules": ALLOWED})
    ranks = [build_data(spec, seed=3, batch_size=5, rank=r, world_size=2, allowed_import_modules=ALLOWED)
             for r in (0, 1)]
    assert not torch.equal(ranks[0].batch(0)[1], ranks[1].batch(0)[1])  # type: ignore[index]
    monkeypatch.setattr(custom_module, "TARGETS_READ_LIMIT", 12)  # 3 batches of 5 reach it
    targets = [r.training_targets() for r in ranks]
    first = torch.cat([ranks[0].batch(i)[1] for i in range(3)])  # type: ignore[index]
    assert targets[0] is not None and targets[1] is not None
    assert torch.equal(targets[0], first) and torch.equal(targets[1], first)
    monkeypatch.setattr(custom_module, "TARGET_BATCHES_LIMIT", 2)
    assert torch.equal(ranks[1].training_targets(), first[:10])  # type: ignore[arg-type]
    short = CustomData.model_validate({"factory": f"{FIX}:make_two_batches"},
                                      context={"allowed_import_modules": ALLOWED})
    monkeypatch.setattr(custom_module, "TARGET_BATCHES_LIMIT", 64)
    two = build_data(short, seed=3, batch_size=5, allowed_import_modules=ALLOWED)
    assert torch.equal(two.training_targets(), torch.cat([two.batch(0)[1], two.batch(1)[1]]))  # type: ignore[arg-type,index]


UNRELATED_DATA = {
    "a Dataset larger than the targets read (a seeded sample)": {
        "name": "dataset", "factory": f"{FIX}:make_unrelated_pairs", "params": {}, "eval_fraction": 0.0},
    "a custom batch factory (its first batches)": {
        "name": "custom", "factory": f"{FIX}:make_unrelated_batch", "params": {}},
}


@pytest.mark.parametrize("data", list(UNRELATED_DATA.values()), ids=list(UNRELATED_DATA))
def test_where_the_targets_are_read_in_part_nothing_learned_is_still_never_learned(
        tmp_path: Path, data: dict[str, Any]) -> None:
    """The trivial loss of data that is read item by item or batch by batch is measured on part of it: a Dataset
    of more items than ``TARGETS_READ_LIMIT`` on a seeded sample, a custom factory on its first batches. Before,
    both were unknown, the way ran to 0, and the classifier that learned only the labels' frequencies (a third of
    the way from ~0.6 to 0) ended SUCCEEDED. The sampled figure is within sampling error of the exact one (the
    label-smoothed frequencies' entropy, 10% of the labels class 1)."""
    recipe = make_recipe(
        model={"params": {"in_features": 8, "hidden": 16, "classes": 2, "depth": 2}}, data=data,
        loss={"name": "cross_entropy"}, training={"max_steps": 80, "batch_size": 32, "seed": 0},
        success={"min_progress": 0.25, "early_min_progress": 0.05},
    )
    res = run(recipe, tmp_path)
    assert res.detector == "never_learned" and "ignores the inputs" in res.reason, res.reason
    smoothing = recipe.loss.label_smoothing
    q = (1 - smoothing) * 0.1 + smoothing / 2
    entropy = -(q * math.log(q) + (1 - q) * math.log(1 - q))
    measured = float(re.search(r"no better than ([0-9.]+),", res.reason).group(1))  # type: ignore[union-attr]
    assert measured == pytest.approx(entropy, abs=0.02)


def test_a_sharded_causal_lm_keeps_its_own_loss_for_the_trivial_loss() -> None:
    """FSDP2's ``fully_shard`` swaps the module's class for a subclass (``FSDPGPT2LMHeadModel``): the causal LM's
    own loss is still known, so its trivial loss too. A real one-rank gloo group, sharded as a run shards it."""
    import torch.distributed as dist

    from workers.models.hf import causal_lm_loss_spec
    from workers.sharding import shard_model

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    try:
        gpt = shard_model(build_model(HFCausalLMModel(config=GPT2), seed=0), torch.device("cpu"))
        assert type(gpt).__name__.startswith("FSDP")
        assert causal_lm_loss_spec(gpt) == CrossEntropyLoss()
    finally:
        dist.destroy_process_group()
