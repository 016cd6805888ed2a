"""The divergence benchmark's reduced form for CI: two cases, few steps, through one real ``ballast serve``.

- SGD beyond 2/λmax on a fixed-design least-squares problem: the ``none`` policy fails the run, ``ballast``
  recovers it to its reference's loss.
- AdamW at a high LR without warmup on tiny_gpt: unguarded, the loss rises above the untrained model's for a step
  or two, falls back and learns slowly, ending far above its reference's loss. Such a degraded end must not be
  reported SUCCEEDED under any policy, and ``ballast`` brings it back to its reference's loss.

Seeds are fixed; the test waits on REST conditions with bounded timeouts and asserts nothing about wall time.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from benchmarks.divergence.cases import Case
from benchmarks.divergence.metrics import TOLERANCE, final_loss, measure
from benchmarks.divergence.run import plan_submissions
from benchmarks.divergence.service import Service
from contracts.recipe import RegressionData
from workers.data import build_data

pytestmark = [pytest.mark.slow, pytest.mark.ray, pytest.mark.timeout(1800)]

STEPS = 60


def _lsq_case() -> Case:
    data = {"name": "regression", "dim": 8, "noise": 0.1, "condition": 5.0, "seed": 3, "fixed_design": True,
            "num_samples": 32}
    lam = build_data(RegressionData(**{k: v for k, v in data.items() if k != "name"}), seed=0,
                     batch_size=32).hessian_lambda_max
    assert lam is not None
    recipe = {
        "name": "smoke-lsq", "model": {"name": "linear"}, "data": data,
        "training": {"max_steps": STEPS, "batch_size": 32, "seed": 0},
        "optimizer": {"name": "sgd", "lr": 1.1 * 2 / lam, "momentum": 0.0},
        "schedule": {"warmup_steps": 0, "decay": "constant"}, "clipping": {"method": "none"},
        "checkpoint": {"every_steps": 10}, "faults": [],
    }
    reference = {**recipe, "optimizer": {"name": "sgd", "lr": 0.5 * 2 / lam, "momentum": 0.0}}
    return Case(name="smoke-lsq", half="ci", family="sgd_beyond_stability_limit", expected="recoverable",
                recipe=recipe, reference=reference)


def _high_lr_case() -> Case:
    recipe = {
        "name": "smoke-highlr",
        "model": {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 1, "n_heads": 2, "d_model": 32},
        "data": {"name": "markov", "vocab_size": 32, "seq_len": 16},
        "training": {"max_steps": STEPS + 40, "batch_size": 16, "seed": 0},
        "optimizer": {"name": "adamw", "lr": 0.1, "weight_decay": 0.01},
        "schedule": {"warmup_steps": 0, "decay": "cosine"}, "checkpoint": {"every_steps": 25}, "faults": [],
    }
    reference = {**recipe, "optimizer": {"name": "adamw", "lr": 0.003, "weight_decay": 0.01},
                 "schedule": {"warmup_steps": 15, "decay": "cosine"}}
    return Case(name="smoke-highlr", half="ci", family="high_lr_no_warmup", expected="recoverable",
                recipe=recipe, reference=reference)


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict[str, Any]]]:
    cases = [_lsq_case(), _high_lr_case()]
    subs, roles = plan_submissions(cases)
    home = Path(tmp_path_factory.mktemp("divergence-smoke"))
    with Service(home) as svc:
        ids = {key: svc.submit(doc) for key, doc in subs}
        svc.wait(list(ids.values()), timeout_s=1500)
        steps = {key: int(doc["training"]["max_steps"]) for key, doc in subs}
        data = {key: svc.collect(rid, max_steps=steps[key]) for key, rid in ids.items()}
    out: dict[str, dict[str, Any]] = {}
    for case in cases:
        ref = data[roles[(case.name, "reference")]]
        ref_final, _ = final_loss(ref, case.max_steps)
        out[case.name] = {"reference": measure(ref, max_steps=case.max_steps, onset_step=None,
                                               reference_final=ref_final)}
        for policy in ("none", "restart-latest", "ballast"):
            out[case.name][policy] = measure(data[roles[(case.name, policy)]], max_steps=case.max_steps,
                                             onset_step=None, reference_final=ref_final)
    yield out


def test_references_train_cleanly(measured: dict[str, dict[str, Any]]) -> None:
    for name, m in measured.items():
        ref = m["reference"]
        assert ref["state"] == "succeeded" and ref["attempts"] == 1, (name, ref["reason"])
        assert ref["final_loss"] is not None and math.isfinite(ref["final_loss"])


def test_ballast_recovers_where_none_fails(measured: dict[str, dict[str, Any]]) -> None:
    m = measured["smoke-lsq"]
    assert m["none"]["state"] == "failed", m["none"]["reason"]
    assert m["none"]["anomalies"] >= 1
    assert m["ballast"]["state"] == "succeeded", m["ballast"]["reason"]
    assert m["ballast"]["rollbacks"] >= 1
    assert m["ballast"]["final_ratio"] is not None and m["ballast"]["final_ratio"] <= TOLERANCE


def test_the_high_lr_run_really_ends_degraded(measured: dict[str, dict[str, Any]]) -> None:
    """The premise of the next test: without recovery the run ends far above its reference."""
    ratio = measured["smoke-highlr"]["none"]["final_ratio"]
    assert ratio is not None and ratio > 1.3


def test_a_degraded_end_is_not_succeeded(measured: dict[str, dict[str, Any]]) -> None:
    for name, m in measured.items():
        for policy in ("none", "restart-latest", "ballast"):
            run = m[policy]
            if run["state"] == "succeeded":
                assert run["final_ratio"] is not None and run["final_ratio"] <= TOLERANCE, (
                    f"{name}/{policy} SUCCEEDED at {run['final_ratio']:.2f}x its reference")


def test_ballast_recovers_the_high_lr_run_to_its_reference(measured: dict[str, dict[str, Any]]) -> None:
    m = measured["smoke-highlr"]
    assert m["none"]["state"] == "failed" and m["none"]["anomalies"] >= 1, m["none"]["reason"]
    assert m["ballast"]["state"] == "succeeded", m["ballast"]["reason"]
    assert m["ballast"]["rollbacks"] >= 1
    assert m["ballast"]["final_ratio"] is not None and m["ballast"]["final_ratio"] <= TOLERANCE
