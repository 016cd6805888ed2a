"""Checkpoint storage against the store, once a worker group is over: what the workers wrote that the store never
heard of, and what is left on storage that nothing names.

A worker writes each checkpoint to storage and announces it through its channel; the scheduler records it when it
drains the channel. A control plane killed between the two (with a local Ray, the channel and its buffered events
die with it) leaves valid checkpoints on storage that the store lacks: the next attempt would resume from an older
one, and retention would never delete them. So whenever a worker group is known to be over (its fit ended, it was
lost while the control plane was down, or the scheduler tore it down) and before the recovery policy picks the
checkpoint to resume from, :func:`reconcile_storage` reads the run's checkpoint directories:

- a complete checkpoint the store lacks (manifest and every file verified) is recorded as the engine's
  ``checkpoint`` event would have recorded it: health, verdict and loss from its manifest, under the attempt the
  manifest names;
- a directory that is incomplete or damaged and that no row names is an orphan: nothing can resume from it;
- a directory whose rows are all marked deleted (retention committed, the scheduler died before removing it) is an
  orphan too.

Orphans are returned for removal after the commit (``retention.remove_checkpoint_dirs``, which deletes only under
the checkpoint root), like retention's surplus. Local storage only: on remote storage (``s3://...``) the worker's
verified load guards a resume, and only what the store knows is deleted.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.orm import Session

from contracts.checkpoint import CorruptCheckpoint, Manifest, local_dir, verify_checkpoint
from orchestrator.scheduler.context import Context
from orchestrator.store.ingest import jsonable
from orchestrator.store.models import Attempt, CheckpointRow, Run

log = logging.getLogger("ballast.scheduler")

STEP_DIR = re.compile(r"^step_(\d+)$")
"""A checkpoint directory's name (``Checkpointer``: ``step_{step:08d}``); Ray Train's own files are not ours."""


def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def group_dirs(ctx: Context, run: Run) -> list[str]:
    """The run's worker-group storage directories (``<storage_path>/<run_name>``), as URIs, oldest first."""
    seen: dict[str, None] = {}
    for a in run.attempts:
        info = a.ray_info or {}
        if info.get("run_name"):
            seen[_join(str(info.get("storage_path") or ctx.settings.checkpoint_root), str(info["run_name"]))] = None
    return list(seen)


def reconcile_storage(ctx: Context, s: Session, run: Run) -> list[str]:
    """Record the run's valid checkpoints the store missed; returns the orphan directories (URIs) to remove once
    committed. Call it only when none of the run's worker groups can still be writing."""
    rows = list(s.scalars(sa.select(CheckpointRow).where(CheckpointRow.run_id == run.id)))
    by_uri: dict[str, list[CheckpointRow]] = {}
    for r in rows:
        by_uri.setdefault(r.uri, []).append(r)
    taken = {(r.attempt_id, r.step) for r in rows}
    attempts = {a.number: a for a in run.attempts}
    orphans: list[str] = []
    found: list[tuple[int, int, str, Path, Manifest]] = []
    for prefix in group_dirs(ctx, run):
        local = local_dir(prefix)
        if local is None or not local.is_dir():
            continue
        for child in sorted(local.iterdir()):
            if not child.is_dir() or STEP_DIR.match(child.name) is None:
                continue
            uri = _join(prefix, child.name)
            known = by_uri.get(uri)
            if known:
                if all(r.deleted for r in known):
                    orphans.append(uri)
                continue
            try:
                manifest = verify_checkpoint(child)
            except CorruptCheckpoint as exc:
                log.warning("run %s: removing %s: not a usable checkpoint (%s)", run.id, uri, exc.reason)
                orphans.append(uri)
                continue
            owner = manifest.meta.get("run_id")
            number = manifest.meta.get("attempt")
            attempt = attempts.get(number) if isinstance(number, int) else None
            if (owner is not None and owner != run.id) or attempt is None:
                log.warning("run %s: leaving %s alone: its manifest names run %s attempt %s", run.id, uri, owner,
                            number)
                continue
            found.append((attempt.number, manifest.step, uri, child, manifest))
    for _, step, uri, _, manifest in sorted(found, key=lambda f: (f[0], f[1])):
        attempt = attempts[int(manifest.meta["attempt"])]
        if (attempt.id, step) in taken:
            continue
        taken.add((attempt.id, step))
        s.add(_row(run, attempt, uri, manifest))
        attempt.last_step = step if attempt.last_step is None else max(attempt.last_step, step)
        log.info("run %s: registered checkpoint %s (attempt %s, step %s) found on storage", run.id, uri,
                 attempt.number, step)
    s.flush()
    return orphans


def _row(run: Run, attempt: Attempt, uri: str, manifest: Manifest) -> CheckpointRow:
    """The row the ``checkpoint`` event would have written (``workers/checkpointing.py`` puts the verdict and the
    health into the manifest's meta; the loss is the verdict's)."""
    verdict = manifest.meta.get("verdict")
    verdict = dict(verdict) if isinstance(verdict, dict) else {}
    return CheckpointRow(
        run_id=run.id, attempt_id=attempt.id, step=manifest.step, uri=uri, sha256=manifest.sha256[:64],
        healthy=bool(manifest.meta.get("healthy", manifest.healthy)), verdict=jsonable(verdict),
        metrics=jsonable({"loss": verdict.get("loss"), "smoothed_loss": verdict.get("smoothed_loss"),
                          "registered_from_storage": True}),
    )
