"""What would a case end at with other settings? Its unstable recipe with ``--set`` changes (dotted paths, JSON
values), trained from scratch in this process with recovery off (``fresh.run``: the ``ballast train`` loop, one
torch thread like a service worker), beside its reference: final ÷ reference loss, the same measure as the
benchmark's table.

For deciding what a retry should change: run the settings a policy chose, and variants of them, without touching the
policy. A from-scratch run approximates a retry that restarts from initialisation; a retry that resumes from a
checkpoint differs. Look at the development half with it, not at the validation half.

    .venv/bin/python -m benchmarks.divergence.what_if dev-rnn-edge-of-chaos \\
        --set optimizer.lr=0.015625 --set schedule.warmup_steps=15 --set schedule.warmup_steps=0

Each ``--set`` is one variant on top of the ones before it (so the example runs lr 1/64 with a 15-step warmup, then
the same without one); ``--faults`` keeps the case's injected faults (dropped by default, as a retry after them).
"""

from __future__ import annotations

import argparse
import copy
import json
from typing import Any

import torch

from benchmarks.divergence.cases import load_cases
from benchmarks.divergence.fresh import run


def parse_set(text: str) -> tuple[list[str], Any]:
    """``a.b=VALUE`` → (["a", "b"], VALUE as JSON, or the bare text if it is not JSON)."""
    path, sep, raw = text.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"--set wants PATH=VALUE, got {text!r}")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return path.split("."), value


def with_setting(doc: dict[str, Any], path: list[str], value: Any) -> dict[str, Any]:
    out = copy.deepcopy(doc)
    node = out
    for key in path[:-1]:
        node = node.setdefault(key, {})
    node[path[-1]] = value
    return out


def what_if(case_name: str, sets: list[tuple[list[str], Any]], *, keep_faults: bool = False) -> list[dict[str, Any]]:
    """One row per variant (the unchanged recipe first): its settings, outcome and final ÷ reference loss."""
    (case,) = load_cases(names=[case_name])
    ref = run(case.reference, {"max_retries": 0})
    doc = copy.deepcopy(case.recipe)
    if not keep_faults:
        doc["faults"] = []
    rows = []
    for i in range(len(sets) + 1):
        if i:
            doc = with_setting(doc, *sets[i - 1])
        res = run(doc, {"max_retries": 0})
        ratio = res["final"] / ref["final"] if res["final"] is not None and ref["final"] else None
        rows.append({"case": case.name, "changed": {".".join(p): v for p, v in sets[:i]}, "outcome": res["outcome"],
                     "final": res["final"], "reference_final": ref["final"],
                     "final_ratio": None if ratio is None else round(ratio, 4)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("case")
    parser.add_argument("--set", dest="sets", action="append", type=parse_set, default=[], metavar="PATH=VALUE")
    parser.add_argument("--faults", action="store_true", help="keep the case's injected faults")
    args = parser.parse_args()
    torch.set_num_threads(1)
    for row in what_if(args.case, args.sets, keep_faults=args.faults):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
