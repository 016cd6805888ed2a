"""The one place a batch becomes a loss: how the model is called, and which loss is taken from its outputs.

``Objective(model, recipe.loss).loss(batch) -> Tensor`` (0-dim float32) is what the training step, DDP priming,
the build-time probe and evaluation all call. The call convention:

| batch | ``loss:`` section | the model is called as | the loss is |
| --- | --- | --- | --- |
| ``(inputs, targets)`` | ``model`` (the default) | ``model((inputs, targets))`` | the scalar it returns (built-ins) |
| ``(inputs, targets)`` | a loss | ``model(inputs)`` | ``loss(outputs, targets)`` |
| a dict | ``model`` | ``model(**batch)`` | ``outputs.loss`` / ``outputs["loss"]`` (Hugging Face) or a scalar |
| a dict | a loss | ``model(**batch)`` | ``loss(outputs, batch["labels"])`` (custom: ``fn(outputs, batch)``) |

The forward runs under the recipe's autocast; the loss is computed outside it, in float32. Outputs may be a tensor,
a Hugging Face ``ModelOutput`` (``.logits``/``.loss``), a dict, or a tuple whose first element is the logits.

``trivial_loss(spec, targets)`` is what learning nothing scores under a loss: the best prediction that ignores the
inputs. The verdict holds a final loss to it (``workers/verdict.py``); built-in data knows its own, and for a
user's dataset the trainer measures it on the training targets with this function.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from contracts.recipe import CrossEntropyLoss, CustomLoss, DType, LossSpec, ModelLoss, MSELoss
from workers.data import Batch, SpecError, resolve_import, to_device
from workers.precision import autocast


def _shape(t: Tensor) -> str:
    return str(tuple(t.shape))


def _field(outputs: Any, name: str) -> Any:
    if isinstance(outputs, Mapping):
        return outputs.get(name)
    return getattr(outputs, name, None)


def own_loss(outputs: Any) -> Tensor:
    """The model's own loss from its outputs (``name: model``), or a SpecError saying what to add."""
    hint = "add a loss: section (cross_entropy, mse or custom)"
    if isinstance(outputs, Tensor):
        loss = outputs
    else:
        loss = _field(outputs, "loss")
        if loss is None:
            what = type(outputs).__name__
            extra = " (does the batch have labels?)" if _field(outputs, "logits") is not None else ""
            raise SpecError(f"loss.name: model returned a {what} without a loss{extra}; {hint}")
        if not isinstance(loss, Tensor):
            raise SpecError(f"loss.name: the model's loss is a {type(loss).__name__}, not a tensor; {hint}")
    if loss.ndim != 0:
        raise SpecError(f"loss.name: model returned a tensor of shape {_shape(loss)}, not a scalar; {hint}")
    if not loss.is_floating_point():
        raise SpecError(f"loss.name: model returned a {loss.dtype} tensor, not a floating-point loss; {hint}")
    return loss


def logits_of(outputs: Any, loss_name: str) -> Tensor:
    """The prediction tensor of ``outputs``: itself, ``.logits`` / ``["logits"]``, or a tuple's first element."""
    if isinstance(outputs, Tensor):
        return outputs
    logits = _field(outputs, "logits")
    if logits is None and isinstance(outputs, tuple | list) and outputs and isinstance(outputs[0], Tensor):
        logits = outputs[0]
    if not isinstance(logits, Tensor):
        raise SpecError(f"loss.name: {loss_name} needs the model to return a tensor or logits, got "
                        f"{type(outputs).__name__}")
    return logits


def cross_entropy(logits: Tensor, targets: Tensor, spec: CrossEntropyLoss) -> Tensor:
    """Mean CE of ``logits [..., C]`` against class indices ``[...]`` (or probabilities ``[..., C]``), in fp32."""
    if logits.ndim < 1:
        raise SpecError(f"loss.name: cross_entropy needs logits [..., C], got shape {_shape(logits)}")
    classes = logits.shape[-1]
    flat = logits.float().reshape(-1, classes)
    if targets.is_floating_point() and targets.shape == logits.shape and classes > 1:
        return F.cross_entropy(flat, targets.float().reshape(-1, classes), label_smoothing=spec.label_smoothing)
    if targets.is_floating_point() or targets.shape != logits.shape[:-1]:
        raise SpecError(f"loss.name: cross_entropy needs logits [..., C] and integer targets [...], got logits "
                        f"{_shape(logits)} and targets {targets.dtype} {_shape(targets)}")
    return F.cross_entropy(flat, targets.reshape(-1).long(), label_smoothing=spec.label_smoothing,
                           ignore_index=spec.ignore_index)


def trivial_loss(spec: LossSpec, targets: Tensor, *, classes: int | None = None) -> float | None:
    """The loss of the best prediction that ignores the inputs, on ``targets`` (the first axis is the samples):
    their per-position mean for ``mse`` (the loss is then their variance), their frequencies for
    ``cross_entropy`` (the loss is the entropy of the label-smoothed frequencies; ``classes``, the logits' size, is
    needed only with smoothing). None where it is not known: a custom loss, the model's own, or targets this loss
    would reject."""
    if isinstance(spec, MSELoss):
        if targets.ndim == 0 or targets.shape[0] < 2:
            return None
        t = targets.double()
        return float((t - t.mean(dim=0)).pow(2).mean())
    if not isinstance(spec, CrossEntropyLoss):
        return None
    eps = spec.label_smoothing
    if targets.is_floating_point():  # class probabilities [..., C]: the best constant guess is their mean
        if targets.ndim < 2 or targets.shape[-1] < 2:
            return None
        mean = targets.double().reshape(-1, targets.shape[-1]).mean(dim=0)
        k = mean.numel()
    else:
        flat = targets.reshape(-1).long()
        flat = flat[flat != spec.ignore_index]
        if flat.numel() == 0 or int(flat.min()) < 0:
            return None
        counts = torch.bincount(flat).double()
        k = classes if classes is not None else counts.numel()
        if counts.numel() > k or (eps > 0.0 and classes is None):
            return None
        mean = F.pad(counts / counts.sum(), (0, k - counts.numel()))
    q = (1.0 - eps) * mean + eps / k
    q = q[q > 0]
    return float(-(q * q.log()).sum())


def mse(outputs: Tensor, targets: Tensor) -> Tensor:
    if outputs.shape != targets.shape:
        raise SpecError(f"loss.name: mse needs outputs and targets of one shape, got {_shape(outputs)} and "
                        f"{_shape(targets)}")
    return F.mse_loss(outputs.float(), targets.float())


class Objective:
    """``loss(batch)``: the scalar mean loss of ``batch`` (see the module docstring for the call convention).

    ``model`` is the user's module; ``loss(batch, model=ddp)`` runs the forward through a wrapper of it instead (the
    training step under DDP). ``device`` (when set) is where the batch is moved first; ``dtype`` the autocast.
    """

    def __init__(
        self,
        model: nn.Module,
        spec: LossSpec | None = None,
        *,
        dtype: DType = DType.fp32,
        device: torch.device | None = None,
        allowed_import_modules: Sequence[str] = (),
    ) -> None:
        self.model = model
        self.spec: LossSpec = spec if spec is not None else ModelLoss()
        self.dtype = dtype
        self.device = device
        self._custom: Callable[..., Any] | None = None
        self.classes: int | None = None
        """The logits' size, once a cross-entropy loss has been computed (``trivial_loss`` needs it with smoothing)."""
        if isinstance(self.spec, CustomLoss):
            self._custom = resolve_import(self.spec.function, allowed_import_modules, field="loss.function")

    @property
    def uses_model_loss(self) -> bool:
        return isinstance(self.spec, ModelLoss)

    def trivial_loss(self, targets: Tensor) -> float | None:
        """``trivial_loss`` under this objective: the recipe's loss, or the model's own where it is known (a
        built-in model's ``loss_spec``, a Hugging Face causal LM's cross-entropy)."""
        from workers.models.builtin import BallastModel  # here: workers.models imports this module
        from workers.models.hf import causal_lm_loss_spec

        spec: LossSpec | None = self.spec
        if isinstance(spec, ModelLoss):
            spec = self.model.loss_spec() if isinstance(self.model, BallastModel) else causal_lm_loss_spec(self.model)
        return None if spec is None else trivial_loss(spec, targets, classes=self.classes)

    def call_convention(self, batch: Batch) -> str:
        """How ``batch`` is passed to the model, for error messages."""
        if isinstance(batch, Mapping):
            return "model(**batch)"
        return "model((inputs, targets))" if self.uses_model_loss else "model(inputs)"

    def outputs(self, batch: Batch, model: nn.Module | None = None) -> Any:
        """The model's outputs on ``batch`` (under autocast), called by the convention."""
        net = model if model is not None else self.model
        if self.device is not None:
            batch = to_device(batch, self.device)
        device = self.device if self.device is not None else torch.device("cpu")
        with autocast(self.dtype, device):
            if isinstance(batch, Mapping):
                return net(**batch)
            if self.uses_model_loss:
                return net(batch)
            return net(batch[0])

    def loss(self, batch: Batch, model: nn.Module | None = None) -> Tensor:
        """The batch's scalar mean loss (0-dim float32, on the model's device); gradients flow through it."""
        if self.device is not None:
            batch = to_device(batch, self.device)
        out = self.outputs(batch, model)
        return self.loss_from(out, batch)

    def loss_from(self, outputs: Any, batch: Batch) -> Tensor:
        """The loss of ``outputs`` (the model's, on ``batch``), in float32 outside autocast."""
        spec = self.spec
        if isinstance(spec, ModelLoss):
            return own_loss(outputs).float()
        targets: Any
        if isinstance(batch, Mapping):
            targets = batch if self._custom is not None else batch.get("labels")
            if targets is None:
                raise SpecError(f"loss.name: {spec.name} needs batch['labels'] in a dict batch (keys: "
                                f"{sorted(batch)})")
        else:
            targets = batch[1]
        if self._custom is not None:
            value = self._custom(outputs, targets)
            if not isinstance(value, Tensor) or value.ndim != 0 or not value.is_floating_point():
                desc = f"a tensor of shape {_shape(value)}" if isinstance(value, Tensor) else type(value).__name__
                raise SpecError(f"loss.function: must return a scalar floating-point tensor, got {desc}")
            return value.float()
        if isinstance(spec, CrossEntropyLoss):
            logits = logits_of(outputs, spec.name)
            self.classes = int(logits.shape[-1]) if logits.ndim else None
            return cross_entropy(logits, targets, spec)
        if isinstance(spec, MSELoss):
            return mse(logits_of(outputs, spec.name), targets)
        raise SpecError(f"loss.name: unknown loss spec {type(spec).__name__}")
