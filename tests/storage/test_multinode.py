"""Multi-node correctness on a real two-node Ray cluster (``multinode_script.py``, in its own process): a local
checkpoint root is refused with the reason; with the S3 bucket as shared storage a 2-worker run placed across
both nodes recovers from an in-place rollback and from one node's worker being killed (from the newest checkpoint
written before the kill)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.storage.s3 import Bucket

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parents[2]


def test_two_nodes_refuse_a_local_root_and_recover_on_shared_storage(bucket: Bucket, tmp_path: Path) -> None:
    out = tmp_path / "result.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "BALLAST_"))}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("multinode_script.py")), bucket.endpoint,
                           bucket.name, str(out)], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=1100)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(out.read_text())
    assert len(result["cluster_nodes"]) == 2

    state, reason = result["refused"]["state"]
    assert state == "failed" and reason is not None
    assert "is a local path, but the Ray cluster has 2 nodes" in reason
    assert "BALLAST_CHECKPOINT_ROOT_SHARED=true" in reason
    ((attempt_state, _),) = result["refused"]["attempts"]
    assert attempt_state == "crashed"

    run = result["run"]
    assert run["state"][0] == "succeeded", run
    first, second, third = run["attempts"]
    a1, a2, a3 = run["attempt_ids"]
    assert (first["kind"], first["state"]) == ("initial", "diverged")
    assert (second["kind"], second["state"], second["in_place"]) == ("numeric_retry", "crashed", True)
    assert second["parent"] == [a1, 20] and second["run_name"] == first["run_name"]  # the same worker group
    assert "worker rank 1 died" in second["error"]
    # the crash restart resumes from the newest lineage checkpoint that was written and verified before the kill:
    # step 30, or step 20 when the kill at step 35 caught step 30's background write still uploading (a crash
    # mid-write leaves the previous checkpoint in force; reconciliation registers step 30 if it was complete)
    lineage = {(c["attempt_id"], c["step"]) for c in run["checkpoints"]
               if (c["attempt_id"], c["step"]) in {(a1, 20), (a2, 30)}}
    newest = max(lineage, key=lambda c: c[1])
    assert (third["kind"], third["state"], third["resume_step"]) == ("crash_restart", "succeeded", newest[1])
    assert third["parent"] == list(newest) and third["run_name"] != first["run_name"]  # a fresh worker group
    # every checkpoint in the bucket, written by a worker group whose two ranks ran on the two different nodes
    live = [c for c in run["checkpoints"] if not c["deleted"]]
    assert live and all(c["uri"].startswith(f"{bucket.root}/") for c in run["checkpoints"])
    for c in live:
        assert len(c["nodes"]) == 2 and set(c["nodes"]) == set(result["cluster_nodes"]), c
    assert {c["attempt_id"] for c in live} >= {a3}
