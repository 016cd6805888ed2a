"""How the commands show API data: numbers (non-finite ones readable), timestamps, state colours, anomaly and
outcome lines, tables, page footers and sparklines. Pure functions of the JSON the server sends."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from rich.table import Table


def as_float(v: Any) -> float | None:
    """A number from the API (non-finite ones arrive as "NaN"/"Infinity") or None."""
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def number(v: Any, fmt: str = ".4g", *, missing: str = "-") -> str:
    """A number compactly; ``nan``/``inf``/``-inf`` for non-finite ones, ``missing`` for none."""
    x = as_float(v)
    if x is None:
        return missing
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return format(x, fmt)


def value(v: Any) -> str:
    """An override's old or new value: numbers compactly, anything else (a method name, a dtype) as is."""
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, int | float):
        return number(v)
    return str(v)


def timestamp(v: Any) -> str:
    return str(v).replace("T", " ")[:16] if v else "-"


def short_timestamp(v: Any) -> str:
    """``MM-DD HH:MM`` (UTC, as the API sends it): a listing's column, where the year costs 5 of 80 columns."""
    return timestamp(v)[5:] if v else "-"


def step_of(summary: Mapping[str, Any]) -> str:
    """``last/max`` steps of a run's summary, or ``-`` before its first step."""
    if summary.get("last_step") is None:
        return "-"
    return f"{summary['last_step']}/{summary.get('max_steps') or '?'}"


def state_style(state: str) -> str:
    return {"succeeded": "bold green", "failed": "bold red", "cancelled": "bold red", "recovering": "bold yellow",
            "config_error": "bold red"}.get(state, "bold")


def failed_as(run: Mapping[str, Any]) -> str:
    """`` [config_error]`` after a failed run's state (its kind of failure), else nothing."""
    kind = run.get("failure_kind")
    return f" [{kind}]" if kind and run.get("state") == "failed" else ""


def action_text(a: Mapping[str, Any]) -> str:
    """What a finding's step did: its action, and for a skip that recurred at unchanged weights the update applied
    instead, clipped to the healthy norm (``details.applied_clipped_to``): ``skip_step`` alone would say the step
    was discarded."""
    clipped = as_float((a.get("details") or {}).get("applied_clipped_to"))
    if clipped is not None and math.isfinite(clipped):
        return f"{a.get('action')} → applied, clipped to {number(clipped)}"
    return str(a.get("action") or "")


def anomaly_line(a: Mapping[str, Any]) -> str:
    thr = f" > {number(a.get('threshold'))}" if a.get("threshold") is not None else ""
    det = f" ({a['detector']})" if a.get("detector") and a.get("detector") != a.get("kind") else ""
    return (
        f"anomaly: attempt {a.get('attempt', '?')} step {a.get('step')}: {a.get('kind')}{det} "
        f"value {number(a.get('value'))}{thr}, action {action_text(a)}"
    )


def outcome_text(att: Mapping[str, Any]) -> str:
    """Why an attempt ended: its reason or error, else where the divergence began."""
    out = att.get("outcome") or {}
    for key in ("reason", "error"):
        if out.get(key):
            return str(out[key])
    if att.get("onset_step") is not None:
        det = f" ({out['detector']})" if out.get("detector") else ""
        return f"onset at step {att['onset_step']}{det}"
    return ""


def overrides_text(overrides: Mapping[str, Any]) -> str:
    """An attempt's overrides diff (``{"optimizer.lr": [old, new]}``) as ``optimizer.lr 0.003→0.0015, ...``."""
    return ", ".join(
        f"{k} {value(v[0])}→{value(v[1])}" if isinstance(v, list) and len(v) == 2 else f"{k}={v}"
        for k, v in overrides.items()
    )


def table(columns: Iterable[str], *, right: Iterable[str] = (), flexible: Iterable[str] = ()) -> Table:
    """A borderless table with bold headers; the columns named in ``right`` are right-aligned.

    With ``flexible`` named, only those columns give way on a narrow terminal (shortened with an ellipsis); the
    others keep their whole values (ids, states, numbers, times), which are short and must stay readable.
    """
    aligned, shrink = set(right), set(flexible)
    out = Table(box=None, pad_edge=False, header_style="bold")
    for col in columns:
        out.add_column(col, justify="right" if col in aligned else "left",
                       no_wrap=bool(shrink) and col not in shrink,
                       overflow="ellipsis" if col in shrink else "fold")
    return out


def page_footer(page: Mapping[str, Any], noun: str) -> str:
    """``N of M <noun>`` for a page of a listing, and how to ask for the next page when there is one."""
    shown = len(page.get("data", []))
    more = f"; next page: --cursor {page['next']}" if page.get("next") else ""
    return f"{shown} of {page.get('count', shown)} {noun}{more}"


_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[Any]) -> str:
    """Unicode sparkline; non-finite points show as '!' so a NaN is visible at a glance."""
    xs = [as_float(v) for v in values]
    finite = [x for x in xs if x is not None and math.isfinite(x)]
    if not finite:
        return "!" * len(xs)
    lo, hi = min(finite), max(finite)
    span = hi - lo or 1.0
    out = []
    for x in xs:
        if x is None or not math.isfinite(x):
            out.append("!")
        else:
            out.append(_SPARK[min(len(_SPARK) - 1, int((x - lo) / span * (len(_SPARK) - 1) + 0.5))])
    return "".join(out)
