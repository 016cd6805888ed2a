"""`ballast export RUN DIR`: the model's weights from one of a run's checkpoints (``ballast.export``)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from typing import Annotated

import typer

from api.cli.app import EXIT_ERROR, app
from api.cli.options import JsonOpt, RunArg, TokenOpt, UrlOpt, connect, console, echo_json


class Format(StrEnum):
    state_dict = "state_dict"
    safetensors = "safetensors"
    hf = "hf"


@app.command("export")
def export(
    run_id: RunArg,
    dest: Annotated[Path, typer.Argument(help="Directory to write into (created if missing).", show_default=False)],
    format: Annotated[Format, typer.Option(
        "--format", help="state_dict: model.pt (torch.save); safetensors: model.safetensors; hf: save_pretrained "
        "(Hugging Face models only).")] = Format.state_dict,
    checkpoint: Annotated[int | None, typer.Option("--checkpoint", min=1, help="Checkpoint id (`runs show`).",
                                                   show_default=False)] = None,
    step: Annotated[int | None, typer.Option("--step", min=0, help="The checkpoint at this step (healthy first).",
                                             show_default=False)] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Write the model's own state dict from a run's checkpoint (default: its latest healthy one), verified
    against the checkpoint's manifest and loadable with strict=True into the recipe's model; also export.json."""
    from ballast.export import ExportError
    from contracts.checkpoint import CorruptCheckpoint

    if checkpoint is not None and step is not None:
        typer.echo("error: pass --checkpoint or --step, not both", err=True)
        raise typer.Exit(EXIT_ERROR)
    with connect(url, token) as client:
        try:
            doc = client.export(run_id, dest, format=format.value, checkpoint=checkpoint, step=step)
        except (ExportError, CorruptCheckpoint) as exc:
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(EXIT_ERROR) from None
    if as_json:
        echo_json(doc)
        return
    ck = doc["checkpoint"]
    files = ", ".join(doc["files"]) or "nothing"
    console().print(f"run {run_id}: checkpoint {ck.get('id')} (attempt {ck.get('attempt')}, step {ck['step']}"
                    f"{', healthy' if ck.get('healthy') else ', UNHEALTHY'}) exported as {doc['format']} to {dest}: "
                    f"{files}", highlight=False)
    if doc["dropped_keys"]:
        console().print(f"dropped {len(doc['dropped_keys'])} duplicated key(s): "
                        + ", ".join(doc["dropped_keys"][:5]) + (" …" if len(doc["dropped_keys"]) > 5 else ""))
