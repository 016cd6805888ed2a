"""Object-store checkpoints end to end: the real scheduler, real Ray Train workers on the session's Ray, and
``BALLAST_CHECKPOINT_ROOT=s3://bucket/ballast`` on a local S3-compatible server (moto). Ray Train persists each
checkpoint through ``storage_filesystem``; the scheduler verifies and prunes them in the bucket; every resume
downloads one from it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contracts.checkpoint import read_manifest
from orchestrator.scheduler import Scheduler
from tests.storage.harness import attempts_of, checkpoints_of, drive, make_store, submit, tiny_recipe
from tests.storage.s3 import Bucket

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(900)]


def test_a_run_on_s3_rolls_back_restarts_and_never_resumes_a_corrupt_checkpoint(
    ray_cluster: Any, bucket: Bucket, tmp_path: Path
) -> None:
    """Attempt 1 diverges at 25 (a gradient spike): with ``recovery.in_place: false`` a new worker group resumes
    from step 20 in the bucket. Attempt 2 damages its step-40 checkpoint in the bucket and crashes: the scheduler's
    verification finds the damage, and attempt 3 resumes from step 30 instead."""
    settings, factory = make_store(tmp_path, **bucket.settings_kwargs())
    keep = 2
    doc = tiny_recipe(name="s3-roundtrip", checkpoint={"every_steps": 10, "keep": keep},
                      recovery={"in_place": False, "rewarm_steps": 5},
                      faults=[{"type": "grad_scale", "step": 25, "factor": 1e4, "attempt": 1},
                              {"type": "corrupt_checkpoint", "step": 40, "attempt": 2}])
    run_id = submit(factory, doc)
    assert drive(Scheduler(settings, factory), factory, run_id) == "succeeded"

    first, second, third = attempts_of(factory, run_id)
    rows = checkpoints_of(factory, run_id)
    by_id = {r.id: r for r in rows}
    assert (first.state, first.onset_step) == ("diverged", 25)
    assert (second.kind, second.state, second.resume_step) == ("numeric_retry", "crashed", 20)
    assert not second.plan.get("in_place") and second.ray_info["run_name"] == f"run-{run_id}-attempt-2"
    assert (third.kind, third.state, third.resume_step) == ("crash_restart", "succeeded", 30)
    # every checkpoint went to the bucket, and each resume's parent is the healthy one the policy chose there
    assert rows and all(r.uri.startswith(f"{bucket.root}/run-{run_id}-attempt-") for r in rows)
    parent2, parent3 = by_id[second.parent_checkpoint_id], by_id[third.parent_checkpoint_id]
    assert (parent2.attempt_id, parent2.step, parent2.healthy) == (first.id, 20, True)
    assert (parent3.attempt_id, parent3.step) == (second.id, 30)
    # the damaged step-40 object failed the scheduler's verification: marked corrupt, not resumed from
    (damaged,) = [r for r in rows if r.attempt_id == second.id and r.step == 40]
    assert "sha256 mismatch" in str((damaged.verdict or {}).get("corrupt"))
    # retention in the bucket: the rows left are exactly the prefixes left, at most keep + the newest healthy one
    live = {r.uri for r in rows if not r.deleted}
    assert any(r.deleted for r in rows)
    assert bucket.checkpoint_prefixes() == live and len(live) <= keep + 1
    # what is there is a complete, verified checkpoint; the newest one is attempt 3's last
    newest = max((r for r in rows if not r.deleted), key=lambda r: r.id)
    assert (newest.attempt_id, newest.step) == (third.id, 50)
    manifest = read_manifest(newest.uri, storage=bucket.storage)
    assert manifest.sha256 == newest.sha256 and len(manifest.meta["nodes"]) == 1
