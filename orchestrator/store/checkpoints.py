"""What the control plane learns about a stored checkpoint after it was registered: that it is corrupt.

A checkpoint found unusable (its files fail verification before a resume, or a worker crashed loading it) is
marked in one place, so every reader agrees: ``healthy`` becomes false (the API never shows ``healthy: true``
beside a corrupt verdict), ``verdict.corrupt`` says why, and an anomaly of kind ``checkpoint_corrupt`` is
recorded on the attempt that wrote it, so the run's anomaly list and the dashboard show what happened.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from contracts import checkpoint as contracts_checkpoint
from contracts.checkpoint import CorruptCheckpoint, local_dir
from orchestrator.store.models import AnomalyRow, CheckpointRow

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


def verify_checkpoint(uri: str, sha256: str | None) -> str | None:
    """Why a checkpoint cannot be resumed from, or None if it can (or cannot be checked from here).

    Local directories are verified fully (manifest checksum, recorded digest, every file's size and sha256),
    so a corrupt newest checkpoint costs no failed attempt. Remote URIs are left to the worker's verified load.
    """
    path = local_dir(uri)
    if path is None:
        return None
    try:
        contracts_checkpoint.verify_checkpoint(path, expected_sha256=sha256 or None)
    except CorruptCheckpoint as exc:
        return exc.reason
    return None
