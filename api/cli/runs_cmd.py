"""`ballast runs list|show|watch|cancel|retry`: monitor and steer runs."""

from __future__ import annotations

from typing import Annotated, Any

import typer
import yaml
from rich.table import Table
from rich.text import Text

from api.cli.app import app, fail
from api.cli.options import CursorOpt, JsonOpt, RunArg, TokenOpt, UrlOpt, connect, console, echo_json
from api.cli.render import (
    failed_as,
    number,
    outcome_text,
    overrides_text,
    page_footer,
    short_timestamp,
    state_style,
    step_of,
    table,
    timestamp,
)
from api.cli.watch import TERMINAL
from api.cli.watch import watch as follow_run
from orchestrator.policy.states import RunState

runs_app = typer.Typer(help="List, inspect, cancel and retry runs.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")


@runs_app.command("list")
def runs_list(
    state: Annotated[
        list[RunState] | None,
        typer.Option("--state", help="Only runs in this state (repeatable).", show_default=False),
    ] = None,
    name: Annotated[str | None, typer.Option("--name", help="Exact run name.", show_default=False)] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=200, help="Runs per page.")] = 20,
    cursor: CursorOpt = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """List runs, newest first."""
    with connect(url, token) as client:
        page = client.list_runs(state=[s.value for s in state or []] or None, name=name, limit=limit, cursor=cursor)
    if as_json:
        echo_json(page)
        return
    # short headers and an MM-DD date: the whole row fits 80 columns with a 16-character name; only NAME gives way
    rows = table(("ID", "NAME", "STATE", "ATT", "RETRY", "STEP", "BEST", "ANOM", "CREATED"),
                 right=("ID", "ATT", "RETRY", "STEP", "BEST", "ANOM"), flexible=("NAME",))
    for r in page.get("data", []):
        s = r.get("summary") or {}
        rows.add_row(
            str(r["id"]), r["name"], Text(r["state"], style=state_style(r["state"])), str(r["current_attempt"]),
            str(s.get("retries_used", 0)), step_of(s), number(s.get("best_loss")), str(s.get("anomalies_total", 0)),
            short_timestamp(r.get("created_at")),
        )
    out = console()
    out.print(rows)
    out.print(page_footer(page, "runs"), style="dim", highlight=False)


def _attempts_table(attempts: list[dict[str, Any]]) -> Table:
    """One row per attempt; the overrides fold onto more lines, the short columns never do. The reasons, which
    run to a sentence, are printed under the table (``_reasons``) at the terminal's full width."""
    rows = table(("#", "KIND", "STATE", "FROM", "LAST", "OVERRIDES"), right=("#", "FROM", "LAST"),
                 flexible=("OVERRIDES",))
    rows.columns[-1].overflow = "fold"
    for a in attempts:
        rows.add_row(
            str(a["number"]), a.get("kind") or "", Text(a["state"], style=state_style(a["state"])),
            str(a.get("resume_step", 0)), "-" if a.get("last_step") is None else str(a["last_step"]),
            overrides_text(a.get("overrides") or {}) or "-",
        )
    return rows


def _reasons(attempts: list[dict[str, Any]]) -> list[Text]:
    """``attempt N: why it started`` and ``attempt N ended: why`` lines, in order."""
    out: list[Text] = []
    for a in attempts:
        n = a["number"]
        if a.get("reason"):
            out.append(Text.assemble((f"attempt {n} started: ", "dim"), str(a["reason"])))
        ended = outcome_text(a)
        if ended and ended != a.get("reason"):
            out.append(Text.assemble((f"attempt {n} ended: ", "dim"), ended))
    return out


@runs_app.command("show")
def runs_show(run_id: RunArg, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """A run: state, current attempt, summary, and every attempt with its settings and reason."""
    with connect(url, token) as client:
        run = client.get_run(run_id)
        attempts = client.attempts(run_id)
    if as_json:
        echo_json({**run, "attempts": attempts})
        return
    s = run.get("summary") or {}
    out = console()
    out.print(
        Text.assemble((f"run {run['id']} ", "bold"), (run["name"], "cyan"), "  ",
                      (run["state"].upper(), state_style(run["state"])), failed_as(run))
    )
    kinds = ", ".join(f"{k} {v}" for k, v in sorted((s.get("anomalies_by_kind") or {}).items())) or "none"
    rows = [
        ("owner", run.get("owner")),
        ("created", timestamp(run.get("created_at"))),
        ("started", timestamp(run.get("started_at"))),
        ("ended", timestamp(run.get("ended_at"))),
        ("step", step_of(s)),
        ("best loss", number(s.get("best_loss"))),
        ("retries", f"{s.get('retries_used', 0)} numeric, {s.get('crash_restarts_used', 0)} crash restarts"),
        ("anomalies", kinds),
        ("reason", run.get("reason") or "-"),
    ]
    if run.get("cancel_requested") and run["state"] not in TERMINAL:
        rows.append(("cancel", "requested"))
    grid = Table.grid(padding=(0, 2))
    for k, v in rows:
        grid.add_row(Text(k, style="dim"), str(v))
    out.print(grid)
    if attempts:
        out.print()
        out.print(_attempts_table(attempts))
        for line in _reasons(attempts):
            out.print(line)


@runs_app.command("watch")
def runs_watch(run_id: RunArg, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Follow a run until it ends (as `submit --watch`): exit 0 if it succeeded, 1 if it failed or was cancelled."""
    raise typer.Exit(follow_run(url, token, run_id, as_json=as_json))


@runs_app.command("cancel")
def runs_cancel(run_id: RunArg, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Cancel a run: a queued one at once; an active one is stopped by the scheduler within seconds."""
    with connect(url, token) as client:
        res = client.cancel_run(run_id)
    if as_json:
        echo_json(res)
        return
    if res["state"] == "cancelled":
        typer.echo(f"run {run_id} cancelled")
    else:
        typer.echo(f"run {run_id}: cancel requested ({res['state']}); the scheduler is stopping it")


def _parse_set(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        path, sep, raw = item.partition("=")
        if not sep or not path.strip():
            raise fail(f"--set {item!r}: expected PATH=VALUE (e.g. optimizer.lr=1e-4)")
        try:
            value = yaml.safe_load(raw) if raw.strip() else raw
        except yaml.YAMLError:
            value = raw
        if isinstance(value, str):
            # YAML 1.1 reads "1e-4" as a string; the recipe wants a number there
            try:
                value = float(value)
            except ValueError:
                pass
        out[path.strip()] = value
    return out


@runs_app.command("retry")
def runs_retry(
    run_id: RunArg,
    lr: Annotated[float | None, typer.Option("--lr", help="New optimizer.lr.", show_default=False)] = None,
    clip: Annotated[float | None, typer.Option("--clip", help="New clipping.max_norm.", show_default=False)] = None,
    sets: Annotated[
        list[str] | None,
        typer.Option("--set", help="Any recipe field: PATH=VALUE (repeatable), e.g. training.max_steps=500.",
                     show_default=False),
    ] = None,
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Follow the retried run until it ends.")] = False,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Retry a failed or cancelled run from its newest healthy checkpoint, optionally with new settings."""
    overrides = _parse_set(sets or [])
    if lr is not None:
        overrides["optimizer.lr"] = lr
    if clip is not None:
        overrides["clipping.max_norm"] = clip
    with connect(url, token) as client:
        res = client.retry_run(run_id, overrides=overrides)
    if watch:
        raise typer.Exit(follow_run(url, token, run_id, as_json=as_json))
    if as_json:
        echo_json(res)
        return
    att = res.get("attempt") or {}
    typer.echo(f"run {run_id}: {res['run']['state']}, attempt {att.get('number')} ({att.get('kind')})"
               + (f": {att['reason']}" if att.get("reason") else ""))
