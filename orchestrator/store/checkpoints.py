"""What the control plane learns about a stored checkpoint after it was registered: that it is corrupt.

A checkpoint found unusable (its files fail verification before a resume, or a worker crashed loading it) is
marked in one place, so every reader agrees: ``healthy`` becomes false (the API never shows ``healthy: true``
beside a corrupt verdict), ``verdict.corrupt`` says why, and an anomaly of kind ``checkpoint_corrupt`` is
recorded on the attempt that wrote it, so the run's anomaly list and the dashboard show what happened.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from contracts import checkpoint as contracts_checkpoint
from contracts.checkpoint import CorruptCheckpoint, local_dir
from contracts.storage import StorageOptions
from contracts.wire import one_line
from orchestrator.store.models import AnomalyRow, CheckpointRow

log = logging.getLogger("ballast.scheduler")

CORRUPT_KIND = "checkpoint_corrupt"


def mark_corrupt(session: Session, row: CheckpointRow, problem: str) -> bool:
    """Mark ``row`` corrupt with ``problem``; False (and nothing written) if it was already marked.

    The anomaly's ``seq`` is the checkpoint row's id, negated: workers number their events from 1, so the
    control plane's own anomaly can never collide with (or be deduplicated against) one a worker sends.
    """
    if (row.verdict or {}).get("corrupt"):
        return False
    row.healthy = False
    row.verdict = {**(row.verdict or {}), "corrupt": problem}
    session.add(AnomalyRow(
        run_id=row.run_id, attempt_id=row.attempt_id, seq=-row.id, step=row.step, rank=0, kind=CORRUPT_KIND,
        detector="verification", value=None, threshold=None, action="record",
        details={"uri": row.uri, "problem": problem},
    ))
    session.flush()
    return True


def verify_checkpoint(uri: str, sha256: str | None, *, storage: StorageOptions | None = None) -> str | None:
    """Why a checkpoint cannot be resumed from, or None if it can.

    Verified fully wherever it lives, a local directory or an object store (``storage``): the manifest checksum,
    the recorded digest, every file's size and sha256, so a corrupt checkpoint costs no failed attempt. A store
    that cannot be reached from here is left to the worker's verified load (logged)."""
    try:
        contracts_checkpoint.verify_checkpoint(uri, expected_sha256=sha256 or None, storage=storage)
    except CorruptCheckpoint as exc:
        return exc.reason
    except OSError as exc:  # the store did not answer: not evidence that the checkpoint is bad
        if local_dir(uri) is not None:
            return f"unreadable: {one_line(exc)}"
        log.warning("could not verify checkpoint %s here: %s", uri, one_line(exc))
    return None
