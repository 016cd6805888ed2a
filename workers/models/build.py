"""The recipe's ``model`` section → a module, checked against the data and the loss before any step runs.

``build_model`` returns the user's module itself (never a wrapper), so its ``state_dict()`` is what a checkpoint
saves and an export hands back. Custom and Hugging Face models are probed once on a data batch through the same
``Objective`` the training step uses, so a contract violation is a SpecError naming the field, not a crash at step 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from contracts.recipe import (
    CustomModel,
    DeepMLPModel,
    Distributed,
    HFCausalLMModel,
    LinearModel,
    LossSpec,
    ModelSpec,
    RecurrentModel,
    TinyGPTModel,
)
from workers.data import Batch, DataDims, SpecError, resolve_import
from workers.models.blocks import attach_blocks, freeze_first_n_blocks, set_activation_checkpointing
from workers.models.builtin import DeepMLP, LinearRegression, RecurrentNet, TinyGPT
from workers.models.hf import build_hf_causal_lm, check_hf_data
from workers.models.lora import apply_lora
from workers.objective import Objective


def _need_dims(spec_name: str, data: DataDims | None, kind: str) -> tuple[int, int]:
    if data is None:
        raise SpecError(f"model.name: {spec_name} needs the data's dimensions (pass data= to build_model)")
    if data.kind != kind or data.input_dim is None or data.output_dim is None:
        raise SpecError(f"data.name: model {spec_name!r} needs {kind} data, got {data.kind} data")
    return data.input_dim, data.output_dim


def _check_tiny_gpt(spec: TinyGPTModel, data: DataDims | None) -> None:
    if data is None:
        return
    if data.kind != "tokens":
        raise SpecError(f"data.name: model 'tiny_gpt' needs token data, got {data.kind} data")
    if data.vocab_size is not None and data.vocab_size != spec.vocab_size:
        raise SpecError(f"data.vocab_size: must equal model.vocab_size ({spec.vocab_size}), got {data.vocab_size}")
    if data.seq_len is not None and data.seq_len > spec.context:
        raise SpecError(f"data.seq_len: {data.seq_len} exceeds model.context ({spec.context})")


def _build(spec: ModelSpec, data: DataDims | None, allowed_import_modules: Sequence[str]) -> nn.Module:
    if isinstance(spec, TinyGPTModel):
        _check_tiny_gpt(spec, data)
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
    if isinstance(spec, HFCausalLMModel):
        return build_hf_causal_lm(spec)
    raise SpecError(f"model.name: unknown model spec {type(spec).__name__}")


def validate_model(
    model: object,
    *,
    field: str = "model.factory",
    probe: Batch | None = None,
    blocks: str | None = None,
    loss: LossSpec | None = None,
    allowed_import_modules: Sequence[str] = (),
) -> nn.Module:
    """Check the model contract (a clear SpecError otherwise): an ``nn.Module``; ``blocks`` (its own, or at the
    attribute path) that are its submodules; and, given a probe batch, a forward that ``Objective`` turns into a
    scalar loss. The probe runs in eval mode under ``no_grad`` with the RNG forked, so it changes no state."""
    if not isinstance(model, nn.Module):
        raise SpecError(f"{field}: must return a torch.nn.Module, got {type(model).__name__}")
    attach_blocks(model, blocks, field=field)
    if probe is not None:
        objective = Objective(model, loss, allowed_import_modules=allowed_import_modules)
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[]):
                objective.loss(probe)
        except SpecError:
            raise
        except Exception as exc:
            hint = ""
            if objective.uses_model_loss and not isinstance(probe, dict):
                hint = ("; with no loss: section the model gets the whole (inputs, targets) batch and must return "
                        "its loss (add a loss: section to call model(inputs))")
            raise SpecError(f"{field}: {objective.call_convention(probe)} failed on a data batch: "
                            f"{type(exc).__name__}: {exc}{hint}") from exc
        finally:
            model.train(was_training)
    return model


def build_model(
    spec: ModelSpec,
    data: DataDims | None = None,
    *,
    seed: int | None = None,
    allowed_import_modules: Sequence[str] = (),
    loss: LossSpec | None = None,
) -> nn.Module:
    """The recipe's ``model`` section → the model itself (in training mode), its blocks found and attached.

    ``data`` (a ``DataSource``) supplies input/output sizes; it is required for deep_mlp, linear and rnn, checked
    against tiny_gpt and Hugging Face models (vocab, positions), and used to probe a custom or Hugging Face model
    with ``loss`` (the recipe's ``loss`` section) on ``data.batch(0)``. With ``seed``, initialisation draws from
    that seed under a forked RNG (the global RNG is left untouched); without it, from the global RNG.
    ``allowed_import_modules`` is re-checked here for custom factories (and custom losses).
    """
    if seed is not None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = _build(spec, data, allowed_import_modules)
    else:
        model = _build(spec, data, allowed_import_modules)
    if isinstance(spec, CustomModel | HFCausalLMModel):
        field = "model.factory" if isinstance(spec, CustomModel) else "model.name"
        if isinstance(spec, HFCausalLMModel):
            check_hf_data(model, data)
        batch_fn = getattr(data, "batch", None)
        probe: Batch | None = batch_fn(0) if callable(batch_fn) else None
        validate_model(model, field=field, probe=probe, blocks=spec.blocks, loss=loss,
                       allowed_import_modules=allowed_import_modules)
        model.train()
    else:
        attach_blocks(model)
    return model


def apply_distributed(model: nn.Module, dist: Distributed) -> nn.Module:
    """The recipe's model-side ``distributed`` options, in the one order the trainer and the preflight probe both
    use: LoRA adapters (which freeze the base), then frozen blocks, then activation checkpointing."""
    if dist.lora is not None:
        apply_lora(model, dist.lora)
    if dist.freeze_first_n_blocks:
        freeze_first_n_blocks(model, dist.freeze_first_n_blocks)
    if dist.activation_checkpointing:
        set_activation_checkpointing(model, True)
    return model
