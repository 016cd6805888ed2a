"""``benchmarks/gpu_check.py --dry-run``: the prepared GPU check runs on the CPU (toy sizes, gloo for NCCL), so a
session that is lent a GPU finds it working. Each part's mechanics are asserted on the numbers it reports; its
speeds mean nothing here and are not looked at.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_every_part_of_the_gpu_check_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(out.read_text())
    assert set(got) == {"env", "precision", "fsdp", "stall", "trace"}
    assert not any("error" in part for part in got.values())

    precision = got["precision"]
    assert all(precision[d]["outcome"] == "succeeded" for d in ("fp32", "bf16", "fp16", "fp16_overflow"))
    overflow = precision["fp16_overflow"]  # the x1e38 gradient: absorbed by the loss scale, no anomaly, no retry
    assert overflow["skipped_steps"] >= 1 and len(overflow["loss_scales"]) >= 2
    assert overflow["anomalies"] == [] and overflow["attempts"] == 1

    fsdp = got["fsdp"]  # the x1e4 spike at step 30 rolled back in place, the second attempt finishing
    assert (fsdp["outcome"], fsdp["final_step"], fsdp["attempts"]) == ("succeeded", 60, 2)
    assert fsdp["anomalies"][0] == [30, "grad_norm_spike"] and fsdp["all_reduce_ok"] is True

    stall = got["stall"]
    assert len(stall["checkpoint_timing"]) == 5 and stall["state_gb"] > 0
    assert stall["stall_s"] >= stall["copy_s"] > 0

    trace = got["trace"]  # checkpointing does not perturb training
    assert trace["max_abs_loss_diff_ckpt_vs_none"] == 0.0
    assert len(trace["lr1e-4"]["loss"]) == len(trace["lr1e-4"]["grad_norm"]) == trace["lr1e-4"]["final_step"]
