"""``benchmarks/divergence/what_if.py``: a case's recipe with changed settings, trained beside its reference.

On the least-squares case (a linear model, seconds on CPU): the unstable recipe as it is diverges, and the same
recipe at its reference's LR trains what the reference trains, so its final ÷ reference loss is 1.
"""

from __future__ import annotations

import argparse

import pytest

from benchmarks.divergence.cases import load_cases
from benchmarks.divergence.what_if import parse_set, what_if, with_setting

CASE = "dev-lsq-sgd-beyond-limit"


def test_the_reference_settings_give_the_reference_loss_and_the_unstable_ones_do_not() -> None:
    (case,) = load_cases(names=[CASE])
    ref_lr = case.reference["optimizer"]["lr"]
    unchanged, at_ref = what_if(CASE, [(["optimizer", "lr"], ref_lr)])
    assert unchanged["changed"] == {} and unchanged["outcome"] != "succeeded"
    assert at_ref["changed"] == {"optimizer.lr": ref_lr}
    assert at_ref["outcome"] == "succeeded" and at_ref["final_ratio"] == 1.0


def test_settings_parse_as_json_and_apply_at_their_path() -> None:
    assert parse_set("schedule.warmup_steps=0") == (["schedule", "warmup_steps"], 0)
    assert parse_set("optimizer.name=sgd") == (["optimizer", "name"], "sgd")
    doc = {"optimizer": {"lr": 1.0, "name": "sgd"}}
    assert with_setting(doc, ["optimizer", "lr"], 0.5) == {"optimizer": {"lr": 0.5, "name": "sgd"}}
    assert doc["optimizer"]["lr"] == 1.0  # the case's own recipe is not changed
    with pytest.raises(argparse.ArgumentTypeError, match="PATH=VALUE"):
        parse_set("optimizer.lr")
