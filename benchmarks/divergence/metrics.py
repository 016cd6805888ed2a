"""What the benchmark measures, as pure functions of what the REST API returned (no I/O here).

Definitions (the README repeats them):

- **lineage curve**: for each step, the training loss recorded by the *newest* attempt that ran that step, i.e.
  the curve the returned model actually followed (a rolled-back branch is replaced by its retry). A step that ran
  (it has an ``lr`` point) but has no loss point had a non-finite loss and counts as +inf.
- **final loss**: the mean of the lineage curve over the last ``FINAL_WINDOW`` (20) steps before ``max_steps``
  (``max_steps - 20 .. max_steps - 1``), leaving out the steps whose update was skipped and that the attempt went
  on from (the ``skipped`` series: their loss is the batch's, not the model's, as the outcome verdict also reads
  it; the step an attempt stopped at keeps its loss); +inf if any of the others is non-finite or none is left. A
  run that stopped early uses the last 20 steps it has (``final_complete`` is then false). The reference's final
  loss is computed the same way, so the ratio compares the same steps (and, without a data-window skip, the same
  batches).
- **steps executed**: every (attempt, step) that ran, summed over attempts: recomputed steps after a rollback
  count again, and so does every step of a retry's LR probe (``recovery.lr_probe``). Reported ÷ ``max_steps``.
- **onset**: injected faults: the fault's step (``case.onset_step``; 0 for a defect present from the start). Natural
  divergences: the first step of attempt 1 whose loss is non-finite or above ``ONSET_RATIO`` (1.5) × the running
  minimum of the earlier steps' losses; none if the loss never does (a plateau, or the detector stopped it first).
- **detection delay**: step of the run's first anomaly (any detector, any action) − onset. Negative: flagged
  before the loss showed it. None: no anomaly (undetected) or no onset.
- **time to recover**: wall seconds from the first anomaly's ingestion to the run's end (server timestamps).
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

FINAL_WINDOW = 20
ONSET_RATIO = 1.5
TOLERANCE = 1.05
STEPS_BUDGET = 1.3


def series(data: dict[str, Any], name: str) -> list[tuple[int, int, float]]:
    """(attempt, step, value) points of one metric series, in (attempt, step) order."""
    s = data["series"].get(name) or {"steps": [], "values": [], "attempts": []}
    return sorted(zip(s["attempts"], s["steps"], s["values"], strict=True))


def lineage_curve(data: dict[str, Any]) -> dict[int, float]:
    """step → loss of the newest attempt that ran the step (+inf where it ran with a non-finite loss)."""
    ran = {(a, st) for a, st, _ in series(data, "lr")}
    loss = {(a, st): float(v) for a, st, v in series(data, "loss")}
    newest: dict[int, int] = {}
    for a, st in ran | set(loss):
        newest[st] = max(newest.get(st, 0), a)
    return {st: loss.get((a, st), math.inf) for st, a in sorted(newest.items())}


def skipped_steps(data: dict[str, Any]) -> set[int]:
    """Steps of the lineage curve whose update was skipped (by the newest attempt that ran them) and that the attempt
    went on from. The step an attempt stopped at keeps its loss although its update was not applied either: that
    loss is the model's (the rollback that ended the attempt was made of it), not an outlying batch's."""
    newest: dict[int, int] = {}
    last: dict[int, int] = {}
    for a, st, _ in series(data, "lr"):
        newest[st] = max(newest.get(st, 0), a)
        last[a] = max(last.get(a, st), st)
    return {st for a, st, _ in series(data, "skipped") if newest.get(st) == a and st < last[a]}


def final_loss(data: dict[str, Any], max_steps: int) -> tuple[float | None, bool]:
    curve = lineage_curve(data)
    if not curve:
        return None, False
    steps = [s for s in range(max_steps - FINAL_WINDOW, max_steps) if s in curve]
    complete = len(steps) == FINAL_WINDOW
    if not complete:
        steps = sorted(curve)[-FINAL_WINDOW:]
    skipped = skipped_steps(data)
    window = [curve[s] for s in steps if s not in skipped]
    if not window or any(not math.isfinite(v) for v in window):
        return math.inf, complete
    return sum(window) / len(window), complete


def steps_executed(data: dict[str, Any]) -> int:
    """Every (attempt, step) that ran, plus the steps of the attempts' LR probes (``plan.lr_probe.steps_run``)."""
    probes = sum(int(((a.get("plan") or {}).get("lr_probe") or {}).get("steps_run") or 0)
                 for a in data.get("attempts") or [])
    return len({(a, st) for a, st, _ in series(data, "lr")}) + probes


def loss_onset(data: dict[str, Any]) -> int | None:
    """First step of attempt 1 whose loss is non-finite or > ONSET_RATIO × the running minimum before it."""
    ran = sorted(st for a, st, _ in series(data, "lr") if a == 1)
    loss = {st: float(v) for a, st, v in series(data, "loss") if a == 1}
    best = math.inf
    for st in ran:
        v = loss.get(st, math.inf)
        if not math.isfinite(v) or (math.isfinite(best) and v > ONSET_RATIO * best):
            return st
        best = min(best, v)
    return None


def _ts(text: str | None) -> datetime | None:
    return datetime.fromisoformat(text.replace("Z", "+00:00")) if text else None


def measure(data: dict[str, Any], *, max_steps: int, onset_step: int | None,
            reference_final: float | None) -> dict[str, Any]:
    """The per-run numbers of the table."""
    run, attempts, anomalies = data["run"], data["attempts"], data["anomalies"]
    final, complete = final_loss(data, max_steps)
    onset = onset_step if onset_step is not None else loss_onset(data)
    first = min(anomalies, key=lambda a: (a["attempt"], a["step"], a["seq"])) if anomalies else None
    delay = first["step"] - onset if first is not None and onset is not None else None
    recover_s = None
    if first is not None and run.get("ended_at"):
        t0, t1 = _ts(first["created_at"]), _ts(run["ended_at"])
        if t0 is not None and t1 is not None:
            recover_s = round((t1 - t0).total_seconds(), 2)
    ratio = None
    if final is not None and reference_final not in (None, 0.0) and reference_final is not None:
        ratio = final / reference_final if math.isfinite(final) and math.isfinite(reference_final) else math.inf
    executed = steps_executed(data)
    return {
        "run_id": run["id"],
        "state": run["state"],
        "reason": run.get("reason"),
        "attempts": len(attempts),
        "retries": max(0, len(attempts) - 1),
        "rollbacks": sum(1 for a in attempts if a["kind"] == "numeric_retry"),
        "final_loss": final,
        "final_complete": complete,
        "final_ratio": ratio,
        "steps_executed": executed,
        "steps_ratio": executed / max_steps,
        "onset_step": onset,
        "first_anomaly_step": first["step"] if first is not None else None,
        "first_anomaly_kind": first["kind"] if first is not None else None,
        "detection_delay": delay,
        "time_to_recover_s": recover_s,
        "anomalies": len(anomalies),
        "attempt_log": [
            {"number": a["number"], "kind": a["kind"], "state": a["state"], "resume_step": a["resume_step"],
             "onset_step": a.get("onset_step"), "last_step": a.get("last_step"), "overrides": a.get("overrides"),
             "reason": a.get("reason")}
            for a in attempts
        ],
    }


def _ok(value: float | None, bound: float) -> bool:
    return value is not None and math.isfinite(value) and value <= bound


def evaluate_targets(rows: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    """The issue's acceptance targets over one half's case rows: (target, passed, detail)."""
    out: list[tuple[str, bool, str]] = []

    def ballast(r: dict[str, Any]) -> dict[str, Any]:
        return r["policies"]["ballast"]

    rec = [r for r in rows if r["expected"] == "recoverable"]
    bad = [r["case"] for r in rec
           if not (ballast(r)["state"] == "succeeded" and _ok(ballast(r)["final_ratio"], TOLERANCE))]
    out.append(("every recoverable case SUCCEEDED within 5% of its reference (ballast)", not bad and bool(rec),
                f"{len(rec) - len(bad)}/{len(rec)} ok" + (f"; not: {', '.join(bad)}" if bad else "")))

    ctl = [r for r in rows if r["expected"] == "control"]
    bad = [r["case"] for r in ctl if not (ballast(r)["attempts"] == 1 and ballast(r)["rollbacks"] == 0)]
    seeds = {r["seed"] for r in ctl}
    out.append(("every control: 1 attempt and 0 rollbacks, on >= 3 seeds (ballast)",
                not bad and len(seeds) >= 3,
                f"{len(ctl) - len(bad)}/{len(ctl)} ok on seeds {sorted(seeds)}" + (f"; not: {', '.join(bad)}"
                                                                                  if bad else "")))

    over = [f"{r['case']} ({ballast(r)['steps_ratio']:.2f}x)" for r in rows
            if ballast(r)["steps_ratio"] > STEPS_BUDGET]
    out.append(("steps executed <= 1.3x max_steps (ballast)", not over,
                "all within" if not over else "over: " + ", ".join(over)))

    van = [r for r in rows if r["expected"] == "unrecoverable-vanishing"]
    bad = [r["case"] for r in van
           if not (ballast(r)["state"] == "failed" and "vanishing" in (ballast(r)["reason"] or "")
                   and ballast(r)["retries"] <= 1)]
    out.append(("vanishing: FAILED with 'vanishing' in the reason after <= 1 retry (ballast)", not bad and bool(van),
                f"{len(van) - len(bad)}/{len(van)} ok" + (f"; not: {', '.join(bad)}" if bad else "")))

    bad = []
    for r in rows:
        for policy, m in r["policies"].items():
            if m["state"] == "succeeded" and not _ok(m["final_ratio"], TOLERANCE):
                ratio = m["final_ratio"]
                shown = "inf" if ratio is None or not math.isfinite(ratio) else f"{ratio:.2f}"
                bad.append(f"{r['case']}/{policy} ({shown}x)")
    out.append(("no run SUCCEEDED with final loss > 1.05x its reference (every policy)", not bad,
                "none" if not bad else f"{len(bad)}: " + ", ".join(bad)))
    return out
