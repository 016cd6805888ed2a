"""`ballast anomalies RUN` and `ballast metrics RUN`: what a run's detectors recorded, and its metric series."""

from __future__ import annotations

from typing import Annotated

import typer

from api.cli.app import app
from api.cli.options import CursorOpt, JsonOpt, RunArg, TokenOpt, UrlOpt, connect, console, echo_json
from api.cli.render import action_text, number, page_footer, sparkline, table

StepMinOpt = Annotated[int | None, typer.Option("--step-min", min=0, show_default=False)]
StepMaxOpt = Annotated[int | None, typer.Option("--step-max", min=0, show_default=False)]
AttemptOpt = Annotated[
    int | None, typer.Option("--attempt", min=1, help="Only this attempt number.", show_default=False)
]


@app.command("anomalies")
def anomalies(
    run_id: RunArg,
    kind: Annotated[str | None, typer.Option("--kind", help="Only this kind (e.g. grad_norm_spike).",
                                             show_default=False)] = None,
    attempt: AttemptOpt = None,
    step_min: StepMinOpt = None,
    step_max: StepMaxOpt = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="Anomalies per page.")] = 100,
    cursor: CursorOpt = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A run's anomalies in the order they were detected."""
    with connect(url, token) as client:
        page = client.anomalies(
            run_id, kind=kind, attempt=attempt, step_min=step_min, step_max=step_max, limit=limit, cursor=cursor
        )
    if as_json:
        echo_json(page)
        return
    rows = table(("ATTEMPT", "STEP", "KIND", "DETECTOR", "VALUE", "THRESHOLD", "ACTION"),
                 right=("ATTEMPT", "STEP", "VALUE", "THRESHOLD"))
    for a in page.get("data", []):
        rows.add_row(
            str(a.get("attempt")), str(a.get("step")), a.get("kind") or "", a.get("detector") or "",
            number(a.get("value")), number(a.get("threshold")), action_text(a),
        )
    out = console()
    out.print(rows)
    out.print(page_footer(page, "anomalies"), style="dim", highlight=False)


@app.command("metrics")
def metrics(
    run_id: RunArg,
    series: Annotated[
        list[str] | None,
        typer.Option("--series", help="loss, grad_norm, grad_norm_clipped, lr, loss_scale, throughput, "
                     "eval_loss (held-out; its steps count completed steps) or skipped (the steps whose update was "
                     "discarded) (repeatable).", show_default="loss"),
    ] = None,
    max_points: Annotated[
        int | None,
        typer.Option("--max-points", min=2, max=10_000,
                     help="Downsample to this many points, keeping each bucket's min and max "
                     "(default 40; with --json, the server's 1000).", show_default=False),
    ] = None,
    attempt: AttemptOpt = None,
    step_min: StepMinOpt = None,
    step_max: StepMaxOpt = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A run's metric series over steps (downsampled so spikes stay visible)."""
    if max_points is None and not as_json:
        max_points = 40
    with connect(url, token) as client:
        body = client.metrics(
            run_id, series=series or ["loss"], max_points=max_points, attempt=attempt, step_min=step_min,
            step_max=step_max,
        )
    if as_json:
        echo_json(body)
        return
    out = console()
    for s in body.get("series", []):
        steps, values, atts = s.get("steps") or [], s.get("values") or [], s.get("attempts") or []
        note = f", downsampled from {s.get('total_points')}" if s.get("downsampled") else ""
        out.print(f"{s['name']} ({len(steps)} points{note})", style="bold", highlight=False)
        if not steps:
            continue
        out.print(sparkline(values), highlight=False)
        columns = ("ATTEMPT", "STEP", s["name"].upper())
        rows = table(columns, right=columns)
        fmt = ".3e" if s["name"] == "lr" else ".5g"
        for i, step in enumerate(steps):
            rows.add_row(str(atts[i]) if i < len(atts) else "-", str(step), number(values[i], fmt))
        out.print(rows)
