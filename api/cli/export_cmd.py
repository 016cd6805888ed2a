"""`ballast export RUN DIR`: the model's weights from one of a run's checkpoints (``ballast.export``), through the
API; or `ballast export CHECKPOINT_DIR DIR --recipe R.yaml` for a local `ballast train --checkpoint-dir` run."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from api.cli.app import app, fail
from api.cli.options import JsonOpt, TokenOpt, UrlOpt, connect, console, echo_json


class Format(StrEnum):
    state_dict = "state_dict"
    safetensors = "safetensors"
    hf = "hf"


@app.command("export")
def export(
    source: Annotated[str, typer.Argument(
        metavar="RUN", help="Run id; or a local checkpoint directory, or a `ballast train --checkpoint-dir` "
        "directory (then --recipe).", show_default=False)],
    dest: Annotated[Path, typer.Argument(help="Directory to write into (created if missing).", show_default=False)],
    format: Annotated[Format, typer.Option(
        "--format", help="state_dict: model.pt (torch.save); safetensors: model.safetensors; hf: save_pretrained "
        "(Hugging Face models only).")] = Format.state_dict,
    checkpoint: Annotated[int | None, typer.Option("--checkpoint", min=1, help="Checkpoint id (`runs show`).",
                                                   show_default=False)] = None,
    step: Annotated[int | None, typer.Option("--step", min=0, help="The checkpoint at this step (healthy first).",
                                             show_default=False)] = None,
    recipe_file: Annotated[Path | None, typer.Option(
        "--recipe", help="The recipe a local checkpoint directory was trained with.", show_default=False)] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write the model's own state dict from a run's checkpoint (default: its latest healthy one), verified
    against the checkpoint's manifest and loadable with strict=True into the recipe's model; also export.json."""
    from ballast.export import ExportError
    from contracts.checkpoint import CorruptCheckpoint

    if checkpoint is not None and step is not None:
        raise fail("pass --checkpoint or --step, not both")
    try:
        if source.isdigit():
            if recipe_file is not None:
                raise fail("--recipe is for a local checkpoint directory; a run's recipe comes from the API")
            with connect(url, token) as client:
                doc = client.export(int(source), dest, format=format.value, checkpoint=checkpoint, step=step)
            what = f"run {source}: checkpoint {doc['checkpoint'].get('id')}"
        else:
            if checkpoint is not None:
                raise fail("--checkpoint is a run's checkpoint id; for a local directory use --step")
            doc = _export_local(Path(source), recipe_file, dest, format.value, step)
            what = str(doc["checkpoint"]["source"])
    except (ExportError, CorruptCheckpoint) as exc:
        raise fail(str(exc)) from None
    if as_json:
        echo_json(doc)
        return
    ck = doc["checkpoint"]
    files = ", ".join(doc["files"]) or "nothing"
    attempt = f"attempt {ck['attempt']}, " if ck.get("attempt") is not None else ""
    console().print(f"{what} ({attempt}step {ck['step']}{', healthy' if ck.get('healthy') else ', UNHEALTHY'}) "
                    f"exported as {doc['format']} to {dest}: {files}", highlight=False)
    if doc["dropped_keys"]:
        console().print(f"dropped {len(doc['dropped_keys'])} duplicated key(s): "
                        + ", ".join(doc["dropped_keys"][:5]) + (" …" if len(doc["dropped_keys"]) > 5 else ""))


def _export_local(source: Path, recipe_file: Path | None, dest: Path, format: str, step: int | None) -> dict[str, Any]:
    from ballast.export import export_checkpoint, find_local_checkpoint
    from contracts.recipe import RecipeError, load_recipe
    from orchestrator.settings import get_settings

    if not source.is_dir():
        raise fail(f"{source}: not a run id, nor a checkpoint directory")
    if recipe_file is None:
        raise fail("--recipe: a local checkpoint directory needs the recipe it was trained with")
    allowed = list(get_settings().allowed_import_modules)
    try:
        recipe = load_recipe(recipe_file.read_bytes(), allowed_import_modules=allowed)
    except OSError as exc:
        raise fail(f"{recipe_file}: {exc.strerror}") from None
    except RecipeError as exc:
        raise fail("; ".join(f"{recipe_file}: {e}" for e in exc.errors)) from None
    path = find_local_checkpoint(source, step=step)
    return export_checkpoint(path, recipe, dest, format=format, allowed_import_modules=allowed,
                             about={"checkpoint": {"source": str(path)}})
