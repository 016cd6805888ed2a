"""Checkpoint retention: keep the newest ``checkpoint.keep`` (by write order) plus the newest healthy one
(``contracts.checkpoint.checkpoints_to_delete``), mark the rest deleted, and remove their directories once that
is committed (never one a live row or an unfinished attempt still names, never outside the checkpoint root), on
disk or on the object store alike (``contracts.storage.Location``)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import sqlalchemy as sa
from sqlalchemy.orm import Session

from contracts.checkpoint import checkpoints_to_delete
from contracts.recipe import RecipeError
from contracts.storage import Location, StorageOptions
from orchestrator.policy.states import TERMINAL_ATTEMPT_STATES
from orchestrator.scheduler.context import Context
from orchestrator.store.models import CheckpointRow, Run

log = logging.getLogger("ballast.scheduler")


def retire_checkpoints(ctx: Context, s: Session, run: Run) -> list[str]:
    """Mark the run's surplus checkpoints deleted; returns the directories to remove once committed."""
    try:
        recipe = ctx.recipe(run)
    except RecipeError:
        return []
    rows = list(s.scalars(sa.select(CheckpointRow)
                          .where(CheckpointRow.run_id == run.id, CheckpointRow.deleted.is_(False))
                          .order_by(CheckpointRow.id)))
    in_use = {a.parent_checkpoint_id for a in run.attempts if a.state not in TERMINAL_ATTEMPT_STATES}
    entries = [(i, r.healthy and not (r.verdict or {}).get("corrupt")) for i, r in enumerate(rows)]
    doomed = [rows[i] for i in checkpoints_to_delete(entries, keep=recipe.checkpoint.keep,
                                                      keep_healthy=recipe.checkpoint.keep_healthy)]
    doomed = [r for r in doomed if r.id not in in_use]
    for r in doomed:
        r.deleted = True
    live_uris = {r.uri for r in rows if not r.deleted}
    s.flush()
    return sorted({r.uri for r in doomed if r.uri and r.uri not in live_uris})


def remove_checkpoint_dirs(uris: Sequence[str], root: str, storage: StorageOptions | None = None) -> None:
    """Delete retired checkpoint directories (or object-store prefixes), only ever under the checkpoint root."""
    for uri in uris:
        if not uri.startswith(root.rstrip("/") + "/"):
            log.warning("not deleting %s: outside the checkpoint root %s", uri, root)
            continue
        try:
            Location(uri, storage).remove()
        except Exception as exc:  # noqa: BLE001 - a leftover directory is not worth failing a run over
            log.warning("could not delete checkpoint %s: %s", uri, exc)
