"""Run by test_multinode.py in a subprocess (Ray allows one cluster per process, and the test session already has
one): a real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``, one CPU per node) driven by the
real scheduler, with checkpoints in the S3 bucket whose endpoint and name come in argv. Writes what the test
checks as JSON to argv[3].

1. A local checkpoint root, not declared shared: the run fails before any worker starts, with the reason.
2. A 2-worker run (one worker per node): a gradient spike at step 25 is rolled back in place to step 20 (every
   rank downloads the checkpoint from the bucket), then rank 1 is SIGKILLed at step 35 and a fresh worker group
   resumes from step 30.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


def main(endpoint: str, bucket_name: str, out: str) -> None:
    os.environ["RAY_TRAIN_V2_ENABLED"] = "1"
    import ray
    from ray.cluster_utils import Cluster

    from contracts.checkpoint import read_manifest
    from orchestrator.scheduler import Scheduler
    from tests.storage.harness import attempts_of, checkpoints_of, drive, make_store, run_state, submit, tiny_recipe
    from tests.storage.s3 import Bucket

    bucket = Bucket(endpoint=endpoint, name=bucket_name)
    small = {"num_cpus": 1, "object_store_memory": 128 * 1024**2}  # beside the session's Ray, on a shared machine
    cluster = Cluster(initialize_head=True, head_node_args={**small, "include_dashboard": False})
    cluster.add_node(**small)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="ballast", log_to_driver=False,
             runtime_env={"env_vars": {"RAY_TRAIN_V2_ENABLED": "1"}})
    result: dict[str, Any] = {"cluster_nodes": sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            local, factory = make_store(Path(tmp) / "local", checkpoint_root=str(Path(tmp) / "ckpt"))
            run_id = submit(factory, tiny_recipe(name="local-root", resources={"num_workers": 2}))
            drive(Scheduler(local, factory), factory, run_id)
            result["refused"] = {"state": run_state(factory, run_id), "attempts": [
                (a.state, (a.outcome or {}).get("error")) for a in attempts_of(factory, run_id)]}

            settings, factory = make_store(Path(tmp) / "s3", **bucket.settings_kwargs())
            doc = tiny_recipe(name="two-nodes", resources={"num_workers": 2, "cpus_per_worker": 1},
                              faults=[{"type": "grad_scale", "step": 25, "factor": 1e4, "attempt": 1},
                                      {"type": "kill_worker", "step": 35, "attempt": 2, "rank": 1}])
            run_id = submit(factory, doc)
            drive(Scheduler(settings, factory), factory, run_id)
            rows = checkpoints_of(factory, run_id)
            by_id = {r.id: r for r in rows}
            result["run"] = {"state": run_state(factory, run_id), "attempts": [
                {"number": a.number, "kind": a.kind, "state": a.state, "resume_step": a.resume_step,
                 "in_place": bool((a.plan or {}).get("in_place")), "run_name": (a.ray_info or {}).get("run_name"),
                 "error": (a.outcome or {}).get("error"),
                 "parent": None if a.parent_checkpoint_id is None else
                 [by_id[a.parent_checkpoint_id].attempt_id, by_id[a.parent_checkpoint_id].step]}
                for a in attempts_of(factory, run_id)],
                "attempt_ids": [a.id for a in attempts_of(factory, run_id)],
                "checkpoints": [{"uri": r.uri, "step": r.step, "attempt_id": r.attempt_id, "deleted": r.deleted,
                                 "nodes": None if r.deleted else
                                 read_manifest(r.uri, storage=bucket.storage).meta.get("nodes")} for r in rows]}
    finally:
        ray.shutdown()
        cluster.shutdown()
    Path(out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
