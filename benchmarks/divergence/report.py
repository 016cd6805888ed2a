"""The benchmark's outputs: the Markdown table per half and one PNG per case (matplotlib, optional extra)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from benchmarks.divergence.metrics import series

POLICY_ORDER = ("none", "restart-latest", "ballast")
COLORS = {"none": "tab:red", "restart-latest": "tab:orange", "ballast": "tab:blue"}


def _num(v: float | None, fmt: str = "{:.2f}") -> str:
    if v is None:
        return "–"
    if isinstance(v, float) and not math.isfinite(v):
        return "inf"
    if isinstance(v, float) and abs(v) >= 1e4:
        return f"{v:.2e}"
    return fmt.format(v)


def markdown_table(rows: list[dict[str, Any]], targets: list[tuple[str, bool, str]], half: str) -> str:
    lines = [f"### {half} half", "",
             "| case | family | expected | policy | outcome | final ÷ ref | attempts (retries) | steps ÷ max | "
             "first anomaly | detection delay | time to recover |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        for policy in POLICY_ORDER:
            m = r["policies"][policy]
            anomaly = f"{m['first_anomaly_kind']} @ {m['first_anomaly_step']}" if m["first_anomaly_kind"] else "–"
            ttr = _num(m["time_to_recover_s"], "{:.1f} s")
            lines.append(
                f"| {r['case'] if policy == 'none' else ''} | {r['family'] if policy == 'none' else ''} | "
                f"{r['expected'] if policy == 'none' else ''} | {policy} | {m['state'].upper()} | "
                f"{_num(m['final_ratio'])} | {m['attempts']} ({m['retries']}) | {_num(m['steps_ratio'])} | "
                f"{anomaly} | {_num(m['detection_delay'], '{:d}')} | {ttr} |")
    lines += ["", "Reference final losses: " + ", ".join(
        f"{r['case']} {_num(r['reference']['final_loss'], '{:.4g}')}"
        + ("" if r["reference"]["state"] == "succeeded" and r["reference"]["attempts"] == 1
           else f" (reference {r['reference']['state']}, {r['reference']['attempts']} attempts)")
        for r in rows), ""]
    lines += [f"**Targets ({half})**", ""]
    lines += [f"- {'PASS' if ok else 'FAIL'}: {name} — {detail}" for name, ok, detail in targets]
    return "\n".join(lines) + "\n"


def reasons_table(rows: list[dict[str, Any]]) -> str:
    """Every retry's reason and overrides, and each run's final reason (what was tried)."""
    lines = []
    for r in rows:
        for policy in POLICY_ORDER:
            m = r["policies"][policy]
            lines.append(f"- **{r['case']} / {policy}**: {m['state']}: {m['reason']}")
            for a in m["attempt_log"][1:]:
                ov = ", ".join(f"{k} {v[0]}→{v[1]}" if isinstance(v, list) and len(v) == 2 else f"{k} {v}"
                               for k, v in (a["overrides"] or {}).items())
                lines.append(f"  - attempt {a['number']} ({a['kind']}, from step {a['resume_step']}"
                             f"{'; ' + ov if ov else ''}): {a['reason']}")
    return "\n".join(lines) + "\n"


def plot_case(row: dict[str, Any], data: dict[str, dict[str, Any]], path: Path) -> None:
    """Loss vs step, one panel per policy, reference dashed; anomalies as x; each rollback as an arrow from the
    step where the attempt ended back to the step the next attempt resumed from."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2), sharey=True)
    ref = data["reference"]
    ref_pts = series(ref, "loss")
    finite = [v for d in data.values() for _, _, v in series(d, "loss") if math.isfinite(v) and v > 0]
    lo = min(finite) if finite else 1e-3
    hi = max(finite) if finite else 1.0
    log = hi / max(lo, 1e-12) > 30
    cap = hi * (3 if log else 1.1)
    for ax, policy in zip(axes, POLICY_ORDER, strict=True):
        d, m = data[policy], row["policies"][policy]
        ax.plot([s for _, s, _ in ref_pts], [v for _, _, v in ref_pts], "k--", lw=1, alpha=0.6, label="reference")
        pts = series(d, "loss")
        attempts = sorted({a for a, _, _ in pts} | {a["number"] for a in d["attempts"]})
        for att in attempts:
            xs = [s for a, s, _ in pts if a == att]
            ys = [v for a, s, v in pts if a == att]
            final = att == attempts[-1]
            ax.plot(xs, ys, color=COLORS[policy], lw=1.4 if final else 1.0, alpha=1.0 if final else 0.4,
                    ls="-", label=f"attempt {att}")
        by_step = {(a, s): v for a, s, v in pts}
        for an in d["anomalies"]:
            y = by_step.get((an["attempt"], an["step"]), cap)
            y = y if math.isfinite(y) else cap
            ax.plot([an["step"]], [y], "x", color="k", ms=7, mew=1.5)
        for prev, nxt in zip(d["attempts"], d["attempts"][1:], strict=False):
            end = prev.get("onset_step")
            end = end if end is not None else prev.get("last_step")
            if end is None:
                continue
            y0 = by_step.get((prev["number"], end), cap)
            y0 = y0 if math.isfinite(y0) else cap
            y1 = by_step.get((nxt["number"], nxt["resume_step"]), y0)
            y1 = y1 if math.isfinite(y1) else y0
            ax.annotate("", xy=(nxt["resume_step"], y1), xytext=(end, y0),
                        arrowprops={"arrowstyle": "->", "color": "purple", "lw": 1.5,
                                    "connectionstyle": "arc3,rad=0.3"})
        if m["onset_step"] is not None:
            ax.axvline(m["onset_step"], color="gray", ls=":", lw=1)
        ratio = m["final_ratio"]
        ax.set_title(f"{policy}: {m['state'].upper()}, final/ref "
                     f"{'inf' if ratio is not None and not math.isfinite(ratio) else _num(ratio)}, "
                     f"{m['attempts']} attempt(s)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_xlim(0, row["max_steps"])
        if log:
            ax.set_yscale("log")
        ax.set_ylim(lo * 0.8 if log else 0, cap)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss")
    handles = [
        matplotlib.lines.Line2D([], [], color="k", ls="--", label="reference (safe setting)"),
        matplotlib.lines.Line2D([], [], color="k", marker="x", ls="", label="anomaly"),
        matplotlib.lines.Line2D([], [], color="purple", label="rollback: end → resumed step"),
        matplotlib.lines.Line2D([], [], color="gray", alpha=0.4, label="abandoned attempt (final: solid)"),
        matplotlib.lines.Line2D([], [], color="gray", ls=":", label="onset (fault step or loss > 1.5x min)"),
    ]
    axes[2].legend(handles=handles, fontsize=8, loc="upper right")
    fig.suptitle(f"{row['case']} ({row['family']}, expected {row['expected']}): {row['summary']}", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
