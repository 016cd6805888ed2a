"""Weights out of a run: the model's own state dict from one of its checkpoints, as ``model.pt``,
``model.safetensors`` or a Hugging Face ``save_pretrained`` directory, with an ``export.json`` beside it.

``export_run`` picks the checkpoint through the API (default: the run's latest healthy one) and reads its files
from the URI the store recorded (a local path, ``file://``, or a URI Ray Train storage reads); ``export_checkpoint``
does the rest for any checkpoint directory: verify every file against the manifest (and the recorded digest),
load the ``model`` part weights-only, clean its keys, rebuild the recipe's model (``workers.models.build_model``;
the user's own module when a wrapper holds it as ``.module``) and load the weights into it with ``strict=True``
before anything is written, so an export always loads back into a fresh model.

Key cleaning: a leading ``module.`` (a DDP/wrapper prefix) is stripped, and a key whose tensor is an alias of an
earlier key's (same storage, offset, shape and strides: a module registered twice, e.g. a custom model's
``blocks`` list over layers it also holds by name) is dropped, unless the rebuilt model expects it by that name
(tied weights, which ``safetensors`` then stores once and ties again on load).

Needs torch (and ``safetensors`` for that format); nothing here is imported by ``import ballast``.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from contracts.checkpoint import CorruptCheckpoint, Manifest, file_sha256, verify_checkpoint
from contracts.recipe import Recipe, RecipeError, validate_recipe_data

if TYPE_CHECKING:
    from api.client import Client

FORMATS = ("state_dict", "safetensors", "hf")
FILES = {"state_dict": "model.pt", "safetensors": "model.safetensors"}
WRAPPER_PREFIX = "module."
EXPORT_JSON = "export.json"


class ExportError(Exception):
    """The export cannot be made; the message says why and what to do instead."""


# ------------------------------------------------------------------------------------------- which checkpoint
def choose_checkpoint(
    checkpoints: list[dict[str, Any]], *, checkpoint_id: int | None = None, step: int | None = None
) -> dict[str, Any]:
    """The checkpoint to export from the API's list: ``checkpoint_id``, else the newest at ``step`` (healthy
    first), else the latest healthy one (newest attempt, then step). Deleted checkpoints are never chosen."""
    live = [c for c in checkpoints if not c.get("deleted")]
    newest_first = sorted(live, key=lambda c: (int(c["attempt"]), int(c["step"]), int(c["id"])), reverse=True)
    if checkpoint_id is not None:
        found = [c for c in checkpoints if int(c["id"]) == checkpoint_id]
        if not found:
            raise ExportError(f"checkpoint {checkpoint_id}: not a checkpoint of this run")
        if found[0].get("deleted"):
            raise ExportError(f"checkpoint {checkpoint_id}: deleted by the retention rule")
        return found[0]
    if step is not None:
        at = [c for c in newest_first if int(c["step"]) == step]
        if not at:
            steps = sorted({int(c["step"]) for c in live})
            raise ExportError(f"step {step}: the run has no checkpoint there (it has steps {steps})")
        return next((c for c in at if c.get("healthy")), at[0])
    healthy = [c for c in newest_first if c.get("healthy")]
    if not healthy:
        raise ExportError("the run has no healthy checkpoint (pass --checkpoint ID or --step N to export another)")
    return healthy[0]


def find_local_checkpoint(root: str | Path, *, step: int | None = None) -> Path:
    """A checkpoint on disk: ``root`` itself when it is one, else among the checkpoints directly under it and
    under its ``attempt-N`` directories (``ballast train --checkpoint-dir``): the newest at ``step`` (healthy
    first), else the latest healthy one (newest attempt, then step)."""
    from contracts.checkpoint import MANIFEST, list_checkpoints, read_manifest

    base = Path(root)
    if (base / MANIFEST).is_file():
        manifest = read_manifest(base)
        if step is not None and manifest.step != step:
            raise ExportError(f"{base}: the checkpoint is at step {manifest.step}, not {step}")
        return base
    found = [(0, path, m) for path, m in list_checkpoints(base)]
    for sub in base.glob("attempt-*"):
        number = sub.name.removeprefix("attempt-")
        if sub.is_dir() and number.isdigit():
            found += [(int(number), path, m) for path, m in list_checkpoints(sub)]
    if not found:
        raise ExportError(f"{base}: no checkpoint there (nor under its attempt-N directories)")
    newest_first = sorted(found, key=lambda f: (f[0], f[2].step), reverse=True)
    if step is not None:
        at = [f for f in newest_first if f[2].step == step]
        if not at:
            raise ExportError(f"step {step}: no checkpoint there (steps {sorted({f[2].step for f in found})})")
        return next((f for f in at if f[2].healthy), at[0])[1]
    healthy = [f for f in newest_first if f[2].healthy]
    if not healthy:
        raise ExportError(f"{base}: no healthy checkpoint (pass --step N to export another)")
    return healthy[0][1]


# ---------------------------------------------------------------------------------------------- state dicts
def _alias_key(t: torch.Tensor) -> tuple[Any, ...]:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)


def clean_state_dict(
    state: Mapping[str, Any], expected: Collection[str] | None = None
) -> tuple[dict[str, Any], list[str]]:
    """(the state dict without wrapper prefixes and duplicated aliases, the dropped keys); see the module
    docstring. ``expected``: the keys of the model the weights are for (an alias it names is kept)."""
    stripped: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in state.items():
        name = key.removeprefix(WRAPPER_PREFIX)
        if name in stripped:
            same = isinstance(value, torch.Tensor) and isinstance(stripped[name], torch.Tensor) and (
                _alias_key(value) == _alias_key(stripped[name]))
            if not same:
                raise ExportError(f"state dict: {key!r} and {name!r} are different tensors under one name")
            dropped.append(key)
            continue
        stripped[name] = value
    out: dict[str, Any] = {}
    seen: dict[tuple[Any, ...], str] = {}
    for name, value in stripped.items():
        if isinstance(value, torch.Tensor) and value.numel() > 0:
            ident = _alias_key(value)
            if ident in seen and (expected is None or name not in expected):
                dropped.append(name)
                continue
            seen.setdefault(ident, name)
        out[name] = value
    return out, dropped


def load_model_state(directory: str | Path, *, expected_sha256: str | None = None) -> tuple[dict[str, Any], Manifest]:
    """Verify the whole checkpoint (CorruptCheckpoint otherwise) and load its ``model`` part weights-only; from a
    sharded (``strategy: fsdp``) checkpoint, the full weights gathered from its shards (no process group needed)."""
    from workers.checkpoint import load_checkpoint
    from workers.sharded_checkpoint import full_parts, shards_of

    manifest = verify_checkpoint(directory, expected_sha256=expected_sha256)
    if shards_of(manifest) is not None:
        state = full_parts(directory, manifest, ["model"])
    else:
        state, manifest = load_checkpoint(directory, expected_sha256=expected_sha256, keys=["model"])
    model = state["model"]
    if not isinstance(model, Mapping):
        raise CorruptCheckpoint(directory, "its model part is not a state dict")
    return dict(model), manifest


def fresh_model(recipe: Recipe, allowed_import_modules: list[str] | None = None) -> nn.Module:
    """The recipe's model, freshly initialised (for custom models the factory must be allow-listed here too)."""
    from workers.data import SpecError, build_data
    from workers.models import build_model

    allowed = list(allowed_import_modules or [])
    try:
        data = build_data(recipe.data, seed=recipe.training.seed, batch_size=recipe.training.batch_size,
                          allowed_import_modules=allowed)
        return build_model(recipe.model, data, seed=recipe.training.seed, allowed_import_modules=allowed,
                           loss=recipe.loss)
    except SpecError as exc:
        raise ExportError(f"cannot rebuild the run's model here: {exc} (custom models: allow their module in "
                          "BALLAST_ALLOWED_IMPORT_MODULES)") from exc


def own_module(model: nn.Module) -> nn.Module:
    """The user's module inside wrappers that hold it as ``.module`` (DDP, an adapter): what the weights are."""
    seen: set[int] = set()
    inner = getattr(model, "module", None)
    while isinstance(inner, nn.Module) and id(model) not in seen:
        seen.add(id(model))
        model, inner = inner, getattr(inner, "module", None)
    return model


def _hf_module(model: nn.Module) -> nn.Module:
    """The outermost module with a ``save_pretrained`` (a Hugging Face model), or ExportError."""
    for module in model.modules():
        if callable(getattr(module, "save_pretrained", None)):
            return module
    raise ExportError(f"--format hf: the model ({type(model).__name__}) is not a Hugging Face model (it has no "
                      "save_pretrained); use --format state_dict or safetensors")


# ------------------------------------------------------------------------------------------------- writing
def export_checkpoint(
    directory: str | Path,
    recipe: Recipe,
    dest: str | Path,
    *,
    format: str = "state_dict",
    expected_sha256: str | None = None,
    allowed_import_modules: list[str] | None = None,
    about: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Export the model weights of the checkpoint at ``directory`` (a run of ``recipe``) into ``dest`` → the
    ``export.json`` document (``about`` adds to it: the run, the checkpoint's id and attempt)."""
    if format not in FORMATS:
        raise ExportError(f"--format: {format!r} is not one of {', '.join(FORMATS)}")
    state, manifest = load_model_state(directory, expected_sha256=expected_sha256)
    model = own_module(fresh_model(recipe, allowed_import_modules))
    target = _hf_module(model) if format == "hf" else model  # before writing anything: a clear error first
    weights, dropped = clean_state_dict(state, expected=model.state_dict().keys())
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as exc:
        raise ExportError(f"the checkpoint's weights do not fit the recipe's model: {exc}") from exc
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    if format == "state_dict":
        torch.save(weights, out / FILES[format])
    elif format == "safetensors":
        from safetensors.torch import save_model

        save_model(model, str(out / FILES[format]))
    else:
        target.save_pretrained(str(out))  # type: ignore[operator]
    doc = {
        **dict(about or {}),
        "format": format,
        "checkpoint": {**dict((about or {}).get("checkpoint") or {}), "step": manifest.step,
                       "sha256": manifest.sha256, "healthy": manifest.healthy},
        "files": {p.name: file_sha256(p) for p in sorted(out.iterdir()) if p.is_file() and p.name != EXPORT_JSON},
        "keys": len(weights),
        "dropped_keys": dropped,
        "model": recipe.model.model_dump(mode="json", by_alias=True),
    }
    (out / EXPORT_JSON).write_text(json.dumps(doc, indent=2) + "\n")
    return doc


def export_run(
    client: Client, run_id: str | int, dest: Path, *, format: str = "state_dict", checkpoint_id: int | None = None,
    step: int | None = None, allowed_import_modules: list[str] | None = None,
) -> dict[str, Any]:
    """``Client.export``: choose the run's checkpoint through the API, fetch it from its URI and export it."""
    from orchestrator.settings import get_settings
    from workers.checkpointing import materialize

    if allowed_import_modules is None:
        allowed_import_modules = list(get_settings().allowed_import_modules)
    if format not in FORMATS:
        raise ExportError(f"--format: {format!r} is not one of {', '.join(FORMATS)}")
    run = client.get_run(run_id)
    chosen = choose_checkpoint(client.checkpoints(run_id), checkpoint_id=checkpoint_id, step=step)
    try:
        recipe = validate_recipe_data(run["recipe"], allowed_import_modules=allowed_import_modules)
    except RecipeError as exc:
        raise ExportError(f"run {run_id}: its recipe does not validate here: {exc}") from exc
    about = {
        "run": {"id": run["id"], "name": run["name"], "state": run["state"]},
        "checkpoint": {"id": chosen["id"], "attempt": chosen["attempt"], "uri": chosen["uri"],
                       "healthy": chosen["healthy"]},
    }
    with materialize(str(chosen["uri"])) as local:
        if local is None or not Path(local).is_dir():
            raise CorruptCheckpoint(chosen["uri"], "no such checkpoint directory (removed, or not reachable here)")
        return export_checkpoint(local, recipe, dest, format=format, expected_sha256=chosen.get("sha256") or None,
                                 allowed_import_modules=allowed_import_modules, about=about)


