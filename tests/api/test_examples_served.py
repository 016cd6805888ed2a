"""The README's "your own model" examples through the service: `ballast serve`, then `ballast submit --watch`.

The user's code reaches the Ray workers only through the recipe's ``code`` section (Ray's ``runtime_env``): the
server and its workers are started without the repository on their path. Each example diverges on its injected
fault in attempt 1, the scheduler rolls it back to a healthy checkpoint before the onset, and the run SUCCEEDS:
the classifier's retry keeps its settings once its LR probe has replayed them cleanly through the failed step
(the fault fires only in attempt 1), the GPT-2 retry halves its LR. The unmodified models train as written (a
classifier with a cross-entropy loss section, a from-scratch Hugging Face GPT-2 on dict batches from a local
token file).
"""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.api.test_cli import BALLAST, _serve_env, _wait_healthy
from tests.ports import free_port

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parents[2]


def shipped(recipe: Path, out: Path, **data: Any) -> Path:
    """The example's recipe with its package shipped to the workers (``code.py_modules``)."""
    doc = yaml.safe_load(recipe.read_text())
    doc["code"] = {"py_modules": [str(REPO / "examples")]}
    doc["data"].update(data)
    out.write_text(yaml.safe_dump(doc, sort_keys=False))
    return out


def test_both_examples_recover_through_the_service(ray_cluster: Any, tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    assert transformers is not None
    from examples.hf_gpt2.data import write_tokens

    recipes = [
        shipped(REPO / "examples/classifier/recipe.yaml", tmp_path / "classifier.yaml"),
        shipped(REPO / "examples/hf_gpt2/recipe.yaml", tmp_path / "gpt2.yaml",
                path=str(write_tokens(tmp_path / "tokens.npy"))),
    ]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = _serve_env(tmp_path / "home", BALLAST_RAY_ADDRESS=ray_cluster.get_runtime_context().gcs_address,
                     BALLAST_SCHEDULER_POLL_SECONDS="0.3", BALLAST_ALLOWED_IMPORT_MODULES="examples")
    env.pop("PYTHONPATH", None)
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        proc = subprocess.Popen([*BALLAST, "serve", "--port", str(port), "--log-level", "warning"], env=env,
                                stdout=log, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    runs: list[dict[str, Any]] = []
    try:
        _wait_healthy(url, proc, timeout=180)
        for i, recipe in enumerate(recipes, start=1):
            watch = subprocess.run([*BALLAST, "submit", str(recipe), "--watch", "--url", url], env=env,
                                   capture_output=True, text=True, timeout=900, cwd=tmp_path)
            diag = f"{recipe.name}:\n{watch.stdout}\n{watch.stderr}\nserver log:\n{log_path.read_text()[-4000:]}"
            assert watch.returncode == 0, diag
            show = subprocess.run([*BALLAST, "runs", "show", str(i), "--json", "--url", url], env=env,
                                  capture_output=True, text=True, timeout=60, cwd=tmp_path)
            runs.append(json.loads(show.stdout))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    for run in runs:
        assert run["state"] == "succeeded" and len(run["attempts"]) >= 2, run
        first, second = run["attempts"][0], run["attempts"][1]
        assert first["state"] == "diverged" and first["onset_step"] is not None
        assert second["kind"] == "numeric_retry" and second["resume_step"] <= first["onset_step"]
    classifier, gpt2 = (run["attempts"][1] for run in runs)
    # the classifier's retry planned a cut LR, but its probe first replayed the diverged settings from the step-50
    # checkpoint through the failed step: the spike fires only in attempt 1, so the replay trained cleanly and the
    # retry kept the recipe's settings (the spike was not theirs)
    probe = classifier["plan"]["lr_probe"]
    assert classifier["overrides"] == {} and probe["replay"] and probe["chosen"] == 0.05, classifier
    assert [c["lr"] for c in probe["candidates_run"]] == [0.05] and "kept (" in classifier["reason"], classifier
    # the GPT-2 run is too short for the probe: its retry halves the LR
    assert gpt2["overrides"] == {"optimizer.lr": [0.003, 0.0015]}, gpt2
    assert runs[1]["attempts"][0]["outcome"]["detector"] == "nonfinite"  # the GPT-2 example's NaN loss
