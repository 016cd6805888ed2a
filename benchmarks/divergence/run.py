"""Run the divergence benchmark: every case under three recovery policies through one real ``ballast serve``.

    .venv/bin/python -m benchmarks.divergence.run --half all --out benchmarks/divergence/results
    .venv/bin/python -m benchmarks.divergence.run --case dev-lsq-sgd-beyond-limit      # one case while iterating

It starts ``ballast serve`` (SQLite, local Ray with BALLAST_RAY_NUM_CPUS=2, BALLAST_MAX_CONCURRENT_RUNS=2) in a
temporary BALLAST_HOME, submits each case's recipe under ``none``, ``restart-latest`` and ``ballast`` plus its
reference (under ``none``) through ``POST /api/v1/runs``, waits for all of them, and reads back over REST: run
state and reason, attempts (kinds, reasons, overrides), anomalies, and the loss/lr series (never downsampled).
Writes ``results.json``, ``results-<half>.md`` (the table and the PASS/FAIL targets), ``reasons-<half>.md`` and
``plots/<case>.png``, and prints the tables. Exit status 0 when every run finished (whatever the targets say:
targets failing is a measurement, not an error), 1 otherwise. See README.md for the definitions.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.divergence.cases import HALVES, POLICIES, Case, load_cases, training_key
from benchmarks.divergence.metrics import evaluate_targets, final_loss, measure
from benchmarks.divergence.service import Service

DEFAULT_OUT = Path(__file__).resolve().parent / "results"


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return "inf" if obj > 0 else ("-inf" if obj < 0 else "nan")
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


def plan_submissions(cases: list[Case]) -> tuple[list[tuple[str, dict[str, Any]]], dict[tuple[str, str], str]]:
    """Unique recipes to submit, and (case, role) → submission key. Roles: the policies and "reference".

    A reference identical in what it trains to another submission (a control's reference is its own `none` run)
    is submitted once: the service is deterministic for a recipe, so running it twice would measure nothing new.
    """
    subs: dict[str, dict[str, Any]] = {}
    roles: dict[tuple[str, str], str] = {}
    for case in cases:
        docs = {policy: case.policy_recipe(policy) for policy in POLICIES}
        docs["reference"] = case.reference_recipe()
        for role, doc in docs.items():
            key = training_key(doc)
            subs.setdefault(key, doc)
            roles[(case.name, role)] = key
    return list(subs.items()), roles


def _serve_and_collect(subs: list[tuple[str, dict[str, Any]]], args: argparse.Namespace,
                       started: float) -> tuple[dict[str, dict[str, Any]], float]:
    home = Path(tempfile.mkdtemp(prefix="ballast-divergence-"))
    collected: dict[str, dict[str, Any]] = {}
    with Service(home) as svc:
        print(f"ballast serve up at {svc.url} (BALLAST_HOME {home}) after {time.monotonic() - started:.0f} s",
              file=sys.stderr)
        ids = {key: svc.submit(doc) for key, doc in subs}
        names = {rid: doc["name"] for (key, doc), rid in zip(subs, ids.values(), strict=True)}

        def progress(run: dict[str, Any], n: int, total: int) -> None:
            print(f"  [{time.monotonic() - started:6.0f} s] {n}/{total} {names[run['id']]}: {run['state']}"
                  f" ({run['current_attempt']} attempt(s))", file=sys.stderr)

        svc.wait(list(ids.values()), timeout_s=args.timeout, progress=progress)
        steps = {training_key(doc): int(doc["training"]["max_steps"]) for _, doc in subs}
        for key, rid in ids.items():
            collected[key] = svc.collect(rid, max_steps=steps[key])
    wall = time.monotonic() - started
    if not args.keep_home:
        import shutil

        shutil.rmtree(home, ignore_errors=True)
    else:
        print(f"kept BALLAST_HOME {home}", file=sys.stderr)
    return collected, wall


def _attach(url: str, subs: list[tuple[str, dict[str, Any]]]) -> tuple[dict[str, dict[str, Any]], float]:
    """The finished runs of an earlier invocation, by name, from a running service; wall = first created to last
    ended."""
    from datetime import datetime

    svc = Service.__new__(Service)
    import httpx

    svc.client = httpx.Client(base_url=url.rstrip("/") + "/api/v1", timeout=60.0)
    by_name: dict[str, dict[str, Any]] = {}
    cursor: str | None = None
    while True:
        page = svc.get("/runs", params={"limit": 200, **({"cursor": cursor} if cursor else {})})
        for run in page["data"]:
            by_name.setdefault(run["name"], run)  # newest first: the latest invocation wins
        cursor = page.get("next")
        if not cursor:
            break
    collected: dict[str, dict[str, Any]] = {}
    times: list[datetime] = []
    for key, doc in subs:
        run = by_name.get(doc["name"])
        if run is None or run["state"] not in ("succeeded", "failed", "cancelled"):
            continue
        collected[key] = svc.collect(run["id"], max_steps=int(doc["training"]["max_steps"]))
        times += [datetime.fromisoformat(run["created_at"]), datetime.fromisoformat(run["ended_at"])]
    wall = (max(times) - min(times)).total_seconds() if times else 0.0
    return collected, wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--half", choices=[*HALVES, "all"], default="all")
    parser.add_argument("--case", action="append", default=None, help="Only this case (repeatable).")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--no-plots", action="store_true", help="Skip the PNGs (no matplotlib needed).")
    parser.add_argument("--timeout", type=float, default=7200.0,
                        help="Seconds to wait for all runs (both halves took 39 min on one 2-core machine, over an "
                             "hour on a slower one).")
    parser.add_argument("--keep-home", action="store_true", help="Keep the service's BALLAST_HOME (prints it).")
    parser.add_argument("--attach", metavar="URL", default=None,
                        help="Submit nothing: read the runs of an earlier invocation from the `ballast serve` at URL "
                             "(found by name) and report the cases whose runs have all finished.")
    args = parser.parse_args(argv)

    if not args.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("matplotlib is missing: `make bench-divergence` installs it (pip install -e '.[bench]'), "
                  "or pass --no-plots", file=sys.stderr)
            return 2

    halves = HALVES if args.half == "all" else (args.half,)
    cases = load_cases(halves, args.case)
    subs, roles = plan_submissions(cases)
    print(f"{len(cases)} case(s), {len(subs)} run(s) to submit", file=sys.stderr)
    started = time.monotonic()
    if args.attach:
        collected, wall = _attach(args.attach, subs)
        cases = [c for c in cases if all(roles[(c.name, role)] in collected for role in (*POLICIES, "reference"))]
        print(f"{len(cases)} case(s) with every run finished", file=sys.stderr)
    else:
        collected, wall = _serve_and_collect(subs, args, started)
    rows: list[dict[str, Any]] = []
    for case in cases:
        ref_data = collected[roles[(case.name, "reference")]]
        ref_final, _ = final_loss(ref_data, case.max_steps)
        reference = measure(ref_data, max_steps=case.max_steps, onset_step=None, reference_final=ref_final)
        row: dict[str, Any] = {
            "case": case.name, "half": case.half, "family": case.family, "expected": case.expected,
            "summary": case.summary, "max_steps": case.max_steps, "seed": case.recipe["training"].get("seed", 0),
            "reference": reference, "policies": {},
        }
        for policy in POLICIES:
            row["policies"][policy] = measure(collected[roles[(case.name, policy)]], max_steps=case.max_steps,
                                              onset_step=case.onset_step, reference_final=ref_final)
        rows.append(row)

    from benchmarks.divergence import report

    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"wall_s": round(wall, 1), "cases": rows, "targets": {}}
    for half in halves:
        half_rows = [r for r in rows if r["half"] == half]
        if not half_rows:
            continue
        targets = evaluate_targets(half_rows)
        results["targets"][half] = [{"target": t, "pass": ok, "detail": d} for t, ok, d in targets]
        table = report.markdown_table(half_rows, targets, half)
        (args.out / f"results-{half}.md").write_text(table)
        (args.out / f"reasons-{half}.md").write_text(report.reasons_table(half_rows))
        print(table)
        for t, ok, d in targets:
            print(f"{'PASS' if ok else 'FAIL'} [{half}] {t}: {d}", file=sys.stderr)
    if not args.no_plots:
        for case, row in zip(cases, rows, strict=True):
            data = {policy: collected[roles[(case.name, policy)]] for policy in POLICIES}
            data["reference"] = collected[roles[(case.name, "reference")]]
            report.plot_case(row, data, args.out / "plots" / f"{case.name}.png")
    (args.out / "results.json").write_text(json.dumps(_json_safe(results), indent=1, allow_nan=False) + "\n")
    print(f"wall time {wall:.0f} s; wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
