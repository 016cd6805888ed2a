"""``/runs/{run_id}/export``: the model's weights from one of the run's checkpoints, as one downloadable file.

The same export as ``ballast export`` (``ballast/export.py``: the same choice of checkpoint, the same verification
against the manifest and the recorded digest, the recipe's model rebuilt and loaded with ``strict=True``), done on
the server, which can read the checkpoint storage a browser cannot. Only the single-file formats (``state_dict``,
``safetensors``); a Hugging Face ``save_pretrained`` directory is the CLI's. The export rebuilds the model on the
API server, so at most ``MAX_CONCURRENT`` run at once; another request meanwhile is a 429 with ``Retry-After``.
"""

from __future__ import annotations

import shutil
import tempfile
import threading
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Query
from fastapi.responses import FileResponse
from starlette.background import BackgroundTask

from api.auth import ReadableRun
from api.deps import MAX_ID, SessionDep, SettingsDep
from api.errors import ApiError, invalid_request, problem_responses
from contracts.checkpoint import CorruptCheckpoint
from contracts.recipe import FieldError, Recipe, RecipeError, validate_recipe_data
from orchestrator.settings import Settings
from orchestrator.store import repo

router = APIRouter(tags=["checkpoints"])

MAX_CONCURRENT = 2
_slots = threading.BoundedSemaphore(MAX_CONCURRENT)


class ExportFormat(StrEnum):
    safetensors = "safetensors"
    state_dict = "state_dict"


@router.get(
    "/runs/{run_id}/export",
    summary="Download the model's weights from a checkpoint of the run",
    description="Default checkpoint: the run's latest healthy one (newest attempt, then step); or `checkpoint` "
    "(an id from `/checkpoints`) or `step` (the newest checkpoint there, healthy first). `format`: "
    "`safetensors` (`model.safetensors`) or `state_dict` (`model.pt`, for `torch.load(weights_only=True)`). "
    "The weights are verified and loaded into the recipe's model before they are sent, so the file always "
    "loads into a fresh model. Headers `X-Ballast-Checkpoint` (id), `X-Ballast-Step` and `X-Ballast-Sha256` "
    "(of the file) say what was sent.",
    response_class=FileResponse,
    responses={
        200: {"description": "The weights file.", "content": {"application/octet-stream": {}}},
        **problem_responses(401, 403, 404, 409, 422, 429),
    },
)
def export_model(
    run: ReadableRun,
    session: SessionDep,
    settings: SettingsDep,
    format: Annotated[ExportFormat, Query(description="The file's format.")] = ExportFormat.safetensors,
    checkpoint: Annotated[int | None, Query(ge=1, le=MAX_ID, description="Checkpoint id.")] = None,
    step: Annotated[int | None, Query(ge=0, le=MAX_ID, description="Checkpoint step.")] = None,
) -> FileResponse:
    from ballast.export import FILES, ExportError, choose_checkpoint  # torch: on the first export only

    if checkpoint is not None and step is not None:
        raise invalid_request([FieldError("query.step", "pass checkpoint or step, not both")],
                              "checkpoint and step both given")
    listed = [{"id": c.id, "attempt": n, "step": c.step, "uri": c.uri, "sha256": c.sha256, "healthy": c.healthy,
               "deleted": c.deleted} for c, n in repo.list_checkpoints(session=session, run_id=run.id)]
    about: dict[str, Any] = {"run": {"id": run.id, "name": run.name, "state": run.state}}
    stem = f"{run.name}-run{run.id}"
    parsed = dict(run.recipe.parsed)
    session.close()  # the export takes seconds: give the connection back first
    try:
        chosen = choose_checkpoint(listed, checkpoint_id=checkpoint, step=step)
    except ExportError as exc:
        if checkpoint is None and step is None:
            raise ApiError(409, str(exc), slug="no-healthy-checkpoint") from None
        field = "query.checkpoint" if checkpoint is not None else "query.step"
        raise invalid_request([FieldError(field, str(exc))], "no such checkpoint to export") from None
    try:
        recipe = validate_recipe_data(parsed, allowed_import_modules=settings.allowed_import_modules)
    except RecipeError as exc:
        raise ApiError(409, f"the run's recipe does not validate on this server: {exc}",
                       slug="export-failed") from None
    about["checkpoint"] = {k: chosen[k] for k in ("id", "attempt", "uri", "healthy")}
    if not _slots.acquire(blocking=False):
        raise ApiError(429, f"{MAX_CONCURRENT} exports are already running; try again shortly",
                       slug="export-busy", headers={"Retry-After": "5"})
    out = Path(tempfile.mkdtemp(prefix="ballast-export-"))
    try:
        doc = _export(chosen, recipe, out, str(format), settings, about)
    except (CorruptCheckpoint, ExportError) as exc:
        shutil.rmtree(out, ignore_errors=True)
        raise ApiError(409, f"checkpoint {chosen['id']} (step {chosen['step']}): {exc}", slug="export-failed") from None
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    finally:
        _slots.release()
    name = FILES[str(format)]
    return FileResponse(
        out / name, media_type="application/octet-stream", filename=f"{stem}-step{chosen['step']}{Path(name).suffix}",
        headers={"X-Ballast-Checkpoint": str(chosen["id"]), "X-Ballast-Step": str(chosen["step"]),
                 "X-Ballast-Sha256": str(doc["files"][name])},
        background=BackgroundTask(shutil.rmtree, out, ignore_errors=True),
    )


def _export(chosen: dict[str, Any], recipe: Recipe, out: Path, format: str, settings: Settings,
            about: dict[str, Any]) -> dict[str, Any]:
    """Fetch the checkpoint from its URI (a local path, or object storage with the server's credentials) and
    export it into ``out``."""
    from ballast.export import export_checkpoint
    from workers.checkpointing import materialize

    with materialize(str(chosen["uri"]), settings.checkpoint_storage()) as local:
        if local is None or not Path(local).is_dir():
            raise CorruptCheckpoint(chosen["uri"], "no such checkpoint directory (removed, or not reachable)")
        doc: dict[str, Any] = export_checkpoint(
            local, recipe, out, format=format, expected_sha256=chosen.get("sha256") or None,
            allowed_import_modules=list(settings.allowed_import_modules), about=about)
    return doc
