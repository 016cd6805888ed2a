"""`ballast submit | runs | anomalies | metrics`: the REST API from a terminal.

Every command takes ``--url`` / ``BALLAST_URL`` and ``--token`` / ``BALLAST_TOKEN`` and ``--json`` for
machine-readable output (the server's response bodies, unchanged). Errors are one line each on stderr and exit
code 2; ``submit --watch`` exits 0 when the run succeeds and 1 when it fails or is cancelled.

``--watch`` polls the API (run, attempts, new anomalies, newest metrics) every half second: simpler and more
robust than a stream (it survives a server restart), and the store is what the user wants to see anyway.
On a terminal it draws a live view; elsewhere (CI logs, pipes) it prints one plain line per event.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Protocol

import typer
import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table
from rich.text import Text

from api.cli.app import app
from api.client import DEFAULT_URL, ApiError, BallastClient, ClientError
from orchestrator.policy.states import TERMINAL_ATTEMPT_STATES, TERMINAL_RUN_STATES, RunState

runs_app = typer.Typer(help="List, inspect, cancel and retry runs.", no_args_is_help=True)
app.add_typer(runs_app, name="runs")

UrlOpt = Annotated[
    str | None,
    typer.Option("--url", envvar="BALLAST_URL", help=f"Ballast server URL (default {DEFAULT_URL}).",
                 show_default=False),
]
TokenOpt = Annotated[
    str | None,
    typer.Option("--token", envvar="BALLAST_TOKEN", help="API token (needed when the server has auth on).",
                 show_default=False),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable output (the API's JSON).")]
CursorOpt = Annotated[
    str | None, typer.Option("--cursor", help="`next` of a previous page.", show_default=False)
]
RunArg = Annotated[int, typer.Argument(help="Run id.", min=1, show_default=False)]

TERMINAL = frozenset(s.value for s in TERMINAL_RUN_STATES)
TERMINAL_ATTEMPT = frozenset(s.value for s in TERMINAL_ATTEMPT_STATES)
EXIT_ERROR = 2
"""Exit code for a refused request or an unreachable server (a run that fails exits 1)."""


def _out() -> Console:
    # resolved at call time so tests capturing stdout (and pipes) get plain text
    return Console(highlight=False, soft_wrap=True)


def _echo_json(data: Any) -> None:
    typer.echo(json.dumps(data, indent=2, default=str))


@contextmanager
def _api(url: str | None, token: str | None, *, prefix: str = "error") -> Iterator[BallastClient]:
    """A client; any ClientError becomes one line per problem on stderr and exit code 2."""
    client = BallastClient(url, token)
    try:
        yield client
    except ClientError as exc:
        for line in exc.lines():
            typer.echo(f"{prefix}: {line}", err=True)
        raise typer.Exit(EXIT_ERROR) from None
    finally:
        client.close()


# ------------------------------------------------------------------------------------------------ formatting
def _f(v: Any) -> float | None:
    """A number from the API (non-finite ones arrive as "NaN"/"Infinity") or None."""
    if v is None or isinstance(v, bool):
        return None
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _num(v: Any, fmt: str = ".4g") -> str:
    x = _f(v)
    if x is None:
        return "-"
    if not math.isfinite(x):
        return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")
    return format(x, fmt)


def _value(v: Any) -> str:
    """An override's old or new value: numbers compactly, anything else (a method name, a dtype) as is."""
    if isinstance(v, bool) or v is None:
        return str(v).lower()
    if isinstance(v, int | float):
        return _num(v)
    return str(v)


def _ts(v: Any) -> str:
    return str(v).replace("T", " ")[:16] if v else "-"


def _anomaly_line(a: dict[str, Any]) -> str:
    thr = f" > {_num(a.get('threshold'))}" if a.get("threshold") is not None else ""
    det = f" ({a['detector']})" if a.get("detector") and a.get("detector") != a.get("kind") else ""
    return (
        f"anomaly: attempt {a.get('attempt', '?')} step {a.get('step')}: {a.get('kind')}{det} "
        f"value {_num(a.get('value'))}{thr}, action {a.get('action')}"
    )


def _outcome_text(att: dict[str, Any]) -> str:
    out = att.get("outcome") or {}
    for key in ("reason", "error"):
        if out.get(key):
            return str(out[key])
    if att.get("onset_step") is not None:
        det = f" ({out['detector']})" if out.get("detector") else ""
        return f"onset at step {att['onset_step']}{det}"
    return ""


# ---------------------------------------------------------------------------------------------------- submit
def _read_recipe(path: Path) -> bytes:
    try:
        return sys.stdin.buffer.read() if str(path) == "-" else path.read_bytes()
    except OSError as exc:
        typer.echo(f"{path}: cannot read: {exc.strerror}", err=True)
        raise typer.Exit(EXIT_ERROR) from None


@app.command("submit")
def submit(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file ('-' for stdin).", show_default=False)],
    watch: Annotated[bool, typer.Option("--watch", "-w", help="Follow the run until it ends.")] = False,
    idempotency_key: Annotated[
        str | None,
        typer.Option("--idempotency-key", help="Resubmitting with the same key returns the same run.",
                     show_default=False),
    ] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Submit a recipe as a run and print its id. The server validates it; each bad field is one line."""
    text = _read_recipe(recipe)
    with _api(url, token, prefix=str(recipe)) as client:
        sub = client.submit_run(text, idempotency_key=idempotency_key)
    run = sub.run
    if not watch:
        if as_json:
            _echo_json(run)
        else:
            again = " (already submitted with this Idempotency-Key)" if not sub.created else ""
            typer.echo(f"run {run['id']} ({run['name']}): {run['state']}{again}")
        return
    raise typer.Exit(_watch(url, token, int(run["id"]), as_json=as_json))


# ------------------------------------------------------------------------------------------------------ watch
@dataclass
class Snapshot:
    """What the live view shows, refreshed on every poll."""

    run_id: int
    name: str = ""
    state: str = ""
    attempt: int = 0
    attempt_state: str = ""
    step: int | None = None
    max_steps: int | None = None
    loss: Any = None
    grad_norm: Any = None
    lr: Any = None
    retries: int = 0
    anomalies: int = 0
    recent: list[str] = field(default_factory=list)


class View(Protocol):
    def event(self, text: str, style: str = "") -> None: ...

    def update(self, snap: Snapshot) -> None: ...

    def close(self) -> None: ...


class PlainView:
    """One line per event, and a progress line every tenth of the run: readable in CI logs."""

    def __init__(self, echo: Callable[[str], None] = typer.echo) -> None:
        self._echo = echo
        self._next_mark: int | None = None
        self._attempt = 0
        self._printed: tuple[int, int] | None = None

    def event(self, text: str, style: str = "") -> None:
        self._echo(text)

    def update(self, snap: Snapshot) -> None:
        if snap.step is None:
            return
        if snap.attempt != self._attempt:
            self._attempt, self._next_mark = snap.attempt, None
        every = max(1, (snap.max_steps or 100) // 10)
        if self._next_mark is None:
            self._next_mark = (snap.step // every) * every  # print the first step we see, then on the grid
        last = bool(snap.max_steps) and snap.step + 1 >= (snap.max_steps or 0)
        if (snap.step >= self._next_mark or last) and self._printed != (snap.attempt, snap.step):
            self._echo(_progress_line(snap))
            self._printed = (snap.attempt, snap.step)
            self._next_mark = (snap.step // every + 1) * every

    def close(self) -> None:
        return None


def _progress_line(snap: Snapshot) -> str:
    total = f"/{snap.max_steps}" if snap.max_steps else ""
    return (
        f"attempt {snap.attempt} step {snap.step}{total} loss {_num(snap.loss)} "
        f"grad_norm {_num(snap.grad_norm)} lr {_num(snap.lr, '.3g')}"
    )


class LiveView:
    """A rich Live panel (attempt, progress bar, loss, grad norm, LR, recent anomalies); events scroll above."""

    def __init__(self, console: Console) -> None:
        self._progress = Progress(
            TextColumn("step"), BarColumn(), MofNCompleteColumn(), TaskProgressColumn(), console=console,
            auto_refresh=False,
        )
        self._task = self._progress.add_task("train", total=None)
        self._snap: Snapshot | None = None
        self._live = Live(self._render(), console=console, refresh_per_second=4, transient=False)
        self._live.start()

    def _render(self) -> Group:
        s = self._snap
        if s is None:
            return Group(Text("waiting for the server ..."))
        head = Text.assemble(
            (f"run {s.run_id} ", "bold"), (s.name, "cyan"), "  ", (s.state.upper(), _state_style(s.state)),
            f"   attempt {s.attempt or '-'}", f" ({s.attempt_state})" if s.attempt_state else "",
            f"   retries {s.retries}   anomalies {s.anomalies}",
        )
        grid = Table.grid(padding=(0, 3))
        grid.add_row(f"loss {_num(s.loss)}", f"grad norm {_num(s.grad_norm)}", f"lr {_num(s.lr, '.3g')}")
        parts: list[Any] = [head, self._progress, grid]
        parts += [Text(r, style="yellow") for r in s.recent[-3:]]
        return Group(*parts)

    def event(self, text: str, style: str = "") -> None:
        # a styled Text, not print(style=...): the style would also paint the live panel redrawn after it
        self._live.console.print(Text(text, style=style))

    def update(self, snap: Snapshot) -> None:
        self._snap = snap
        done = (snap.step + 1) if snap.step is not None else 0
        self._progress.update(self._task, total=snap.max_steps, completed=done)
        self._live.update(self._render(), refresh=True)

    def close(self) -> None:
        if self._live.is_started:
            self._live.stop()


def _state_style(state: str) -> str:
    return {"succeeded": "bold green", "failed": "bold red", "cancelled": "bold red", "recovering": "bold yellow"}.get(
        state, "bold"
    )


class Tracker:
    """Turns successive polls of the API into view events: run state changes, attempts starting and ending
    (with the recovery reason of each retry), new anomalies, and the newest metrics."""

    def __init__(self, client: BallastClient, run_id: int, view: View) -> None:
        self.client, self.run_id, self.view = client, run_id, view
        self.snap = Snapshot(run_id=run_id)
        self._attempt_states: dict[int, str] = {}
        self._seen_anomalies: set[int] = set()
        self._anomaly_step: dict[int, int] = {}
        self._metric_step: dict[int, int] = {}

    def poll(self) -> dict[str, Any]:
        """One round; returns the run (RunDetail). Terminal once ``run["state"]`` is in TERMINAL."""
        run = self.client.get_run(self.run_id)
        s = self.snap
        if run["state"] != s.state:
            self._run_changed(run)
        s.name, s.state = run["name"], run["state"]
        summary = run.get("summary") or {}
        s.max_steps, s.retries = summary.get("max_steps"), int(summary.get("retries_used") or 0)
        s.anomalies = int(summary.get("anomalies_total") or 0)
        if run.get("current_attempt"):
            for att in self.client.attempts(self.run_id):
                self._attempt(att)
        self.view.update(s)
        return run

    def _run_changed(self, run: dict[str, Any]) -> None:
        state = run["state"]
        if state in TERMINAL:
            return  # the closing summary says it
        explain = run.get("reason") and state in ("recovering", "queued") and self.snap.state
        why = f": {run['reason']}" if explain else ""
        self.view.event(f"run {run['id']} ({run['name']}): {state}{why}", _state_style(state))

    def _attempt(self, att: dict[str, Any]) -> None:
        n, state = int(att["number"]), str(att["state"])
        prev = self._attempt_states.get(n)
        s = self.snap
        if n > s.attempt:
            # a new attempt: the numbers on show are its own from now on, not the previous attempt's
            s.attempt, s.step, s.loss, s.grad_norm, s.lr = n, None, None, None, None
        if prev is None:
            kind = att.get("kind") or "initial"
            start = f", from step {att['resume_step']}" if att.get("resume_step") else ""
            self.view.event(f"attempt {n} started ({kind}{start})", "bold")
            if kind != "initial" and att.get("reason"):
                self.view.event(f"recovery: {att['reason']}", "bold yellow")
        if prev is None or prev not in TERMINAL_ATTEMPT:
            # an attempt that just ended gets one last look, so nothing it reported is missed
            self._new_anomalies(n)
            self._metrics(n)
            if n == s.attempt:
                self.view.update(s)  # progress before the attempt's end line
        if state in TERMINAL_ATTEMPT and prev not in TERMINAL_ATTEMPT:
            at = f" at step {att['last_step']}" if att.get("last_step") is not None else ""
            why = _outcome_text(att)
            style = "green" if state == "succeeded" else "red"
            self.view.event(f"attempt {n} {state}{at}" + (f": {why}" if why else ""), style)
        self._attempt_states[n] = state
        if n == s.attempt:
            s.attempt_state = state

    def _new_anomalies(self, n: int) -> None:
        # within an attempt anomalies come in step order, so asking from the newest step seen keeps pages small
        rows = self.client.all_anomalies(self.run_id, attempt=n, step_min=self._anomaly_step.get(n))
        for a in rows:
            if int(a["id"]) in self._seen_anomalies:
                continue
            self._seen_anomalies.add(int(a["id"]))
            self._anomaly_step[n] = max(self._anomaly_step.get(n, 0), int(a["step"]))
            line = _anomaly_line(a)
            self.snap.recent = [*self.snap.recent[-2:], line]
            self.view.event(line, "yellow")

    def _metrics(self, n: int) -> None:
        body = self.client.metrics(
            self.run_id, series=("loss", "grad_norm", "lr"), attempt=n, step_min=self._metric_step.get(n),
            max_points=10_000,
        )
        latest: dict[str, Any] = {}
        step: int | None = None
        for series in body.get("series", []):
            steps, values = series.get("steps") or [], series.get("values") or []
            if steps and values:
                latest[series["name"]] = values[-1]
                step = max(step or 0, int(steps[-1]))
        if step is None:
            return
        self._metric_step[n] = step
        if n == self.snap.attempt:
            s = self.snap
            s.step, s.loss, s.grad_norm, s.lr = step, latest.get("loss"), latest.get("grad_norm"), latest.get("lr")


def _watch(
    url: str | None,
    token: str | None,
    run_id: int,
    *,
    as_json: bool = False,
    interval: float = 0.5,
    patience: float = 60.0,
) -> int:
    """Follow a run to its end; the exit code is 0 if it succeeded, 1 if it failed or was cancelled."""
    console = _out()
    view: View
    if as_json:
        view = PlainView(echo=lambda _line: None)
    elif console.is_terminal:
        view = LiveView(console)
    else:
        view = PlainView()
    with _api(url, token) as client:
        tracker = Tracker(client, run_id, view)
        lost_since: float | None = None
        try:
            while True:
                try:
                    run = tracker.poll()
                    if lost_since is not None:
                        view.event("connection to the server restored")
                    lost_since = None
                except ClientError as exc:
                    # a server restarting (crash recovery) or a database blip must not end the watch; a server
                    # that stays away, or any refusal (404, 401, ...), does
                    if isinstance(exc, ApiError) and exc.status < 500:
                        raise
                    now = time.monotonic()
                    if lost_since is None:
                        lost_since = now
                        view.event(f"lost contact with the server, retrying ({exc})", "red")
                    elif now - lost_since > patience:
                        raise
                    time.sleep(interval)
                    continue
                if run["state"] in TERMINAL:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            view.close()
            typer.echo(f"stopped watching; run {run_id} continues (`ballast runs cancel {run_id}` stops it)",
                       err=True)
            return 130
        finally:
            view.close()
    state = run["state"]
    if as_json:
        _echo_json(run)
    else:
        summary = run.get("summary") or {}
        n = run.get("current_attempt") or 0
        retries = int(summary.get("retries_used") or 0)
        tail = f"{n} attempt{'s' if n != 1 else ''}, {retries} retr{'ies' if retries != 1 else 'y'}"
        if summary.get("best_loss") is not None:
            tail += f", best loss {_num(summary['best_loss'])}"
        reason = f": {run['reason']}" if run.get("reason") and state != "succeeded" else ""
        console.print(f"run {run_id} {state.upper()} ({tail}){reason}", style=_state_style(state), highlight=False)
    return 0 if state == "succeeded" else 1


# ------------------------------------------------------------------------------------------------------- runs
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
    with _api(url, token) as client:
        page = client.list_runs(state=[s.value for s in state or []] or None, name=name, limit=limit, cursor=cursor)
    if as_json:
        _echo_json(page)
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("ID", "NAME", "STATE", "ATTEMPT", "RETRIES", "STEP", "BEST LOSS", "ANOMALIES", "CREATED"):
        table.add_column(col, justify="right" if col in {"ID", "ATTEMPT", "RETRIES", "ANOMALIES"} else "left")
    for r in page.get("data", []):
        s = r.get("summary") or {}
        step = "-" if s.get("last_step") is None else f"{s['last_step']}/{s.get('max_steps') or '?'}"
        table.add_row(
            str(r["id"]), r["name"], Text(r["state"], style=_state_style(r["state"])), str(r["current_attempt"]),
            str(s.get("retries_used", 0)), step, _num(s.get("best_loss")), str(s.get("anomalies_total", 0)),
            Text(_ts(r.get("created_at")), no_wrap=True),
        )
    console = _out()
    console.print(table)
    shown = len(page.get("data", []))
    more = f"; next page: --cursor {page['next']}" if page.get("next") else ""
    console.print(f"{shown} of {page.get('count', shown)} runs{more}", style="dim", highlight=False)


@runs_app.command("show")
def runs_show(run_id: RunArg, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """A run: state, current attempt, summary, and every attempt with its settings and reason."""
    with _api(url, token) as client:
        run = client.get_run(run_id)
        attempts = client.attempts(run_id)
    if as_json:
        _echo_json({**run, "attempts": attempts})
        return
    s = run.get("summary") or {}
    console = _out()
    console.print(
        Text.assemble((f"run {run['id']} ", "bold"), (run["name"], "cyan"), "  ",
                      (run["state"].upper(), _state_style(run["state"])))
    )
    step = "-" if s.get("last_step") is None else f"{s['last_step']}/{s.get('max_steps') or '?'}"
    kinds = ", ".join(f"{k} {v}" for k, v in sorted((s.get("anomalies_by_kind") or {}).items())) or "none"
    rows = [
        ("owner", run.get("owner")),
        ("created", _ts(run.get("created_at"))),
        ("started", _ts(run.get("started_at"))),
        ("ended", _ts(run.get("ended_at"))),
        ("step", step),
        ("best loss", _num(s.get("best_loss"))),
        ("retries", f"{s.get('retries_used', 0)} numeric, {s.get('crash_restarts_used', 0)} crash restarts"),
        ("anomalies", kinds),
        ("reason", run.get("reason") or "-"),
    ]
    if run.get("cancel_requested") and run["state"] not in TERMINAL:
        rows.append(("cancel", "requested"))
    grid = Table.grid(padding=(0, 2))
    for k, v in rows:
        grid.add_row(Text(k, style="dim"), str(v))
    console.print(grid)
    if attempts:
        table = Table(box=None, pad_edge=False, header_style="bold", title_justify="left")
        for col in ("#", "KIND", "STATE", "FROM", "LAST", "OVERRIDES", "REASON"):
            table.add_column(col, overflow="fold")
        for a in attempts:
            ov = ", ".join(
                f"{k} {_value(v[0])}→{_value(v[1])}" if isinstance(v, list) and len(v) == 2 else f"{k}={v}"
                for k, v in (a.get("overrides") or {}).items()
            )
            table.add_row(
                str(a["number"]), a.get("kind") or "", Text(a["state"], style=_state_style(a["state"])),
                str(a.get("resume_step", 0)), "-" if a.get("last_step") is None else str(a["last_step"]),
                ov or "-", a.get("reason") or _outcome_text(a) or "-",
            )
        console.print()
        console.print(table)


@runs_app.command("watch")
def runs_watch(run_id: RunArg, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Follow a run until it ends (as `submit --watch`): exit 0 if it succeeded, 1 if it failed or was cancelled."""
    raise typer.Exit(_watch(url, token, run_id, as_json=as_json))


@runs_app.command("cancel")
def runs_cancel(run_id: RunArg, url: UrlOpt = None, token: TokenOpt = None, as_json: JsonOpt = False) -> None:
    """Cancel a run: a queued one at once; an active one is stopped by the scheduler within seconds."""
    with _api(url, token) as client:
        res = client.cancel_run(run_id)
    if as_json:
        _echo_json(res)
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
            typer.echo(f"error: --set {item!r}: expected PATH=VALUE (e.g. optimizer.lr=1e-4)", err=True)
            raise typer.Exit(EXIT_ERROR)
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
    with _api(url, token) as client:
        res = client.retry_run(run_id, overrides=overrides)
    if watch:
        raise typer.Exit(_watch(url, token, run_id, as_json=as_json))
    if as_json:
        _echo_json(res)
        return
    att = res.get("attempt") or {}
    typer.echo(f"run {run_id}: {res['run']['state']}, attempt {att.get('number')} ({att.get('kind')})"
               + (f": {att['reason']}" if att.get("reason") else ""))


# ------------------------------------------------------------------------------------------ anomalies, metrics
@app.command("anomalies")
def anomalies(
    run_id: RunArg,
    kind: Annotated[str | None, typer.Option("--kind", help="Only this kind (e.g. grad_norm_spike).",
                                             show_default=False)] = None,
    attempt: Annotated[int | None, typer.Option("--attempt", min=1, help="Only this attempt number.",
                                                show_default=False)] = None,
    step_min: Annotated[int | None, typer.Option("--step-min", min=0, show_default=False)] = None,
    step_max: Annotated[int | None, typer.Option("--step-max", min=0, show_default=False)] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, max=1000, help="Anomalies per page.")] = 100,
    cursor: CursorOpt = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A run's anomalies in the order they were detected."""
    with _api(url, token) as client:
        page = client.anomalies(
            run_id, kind=kind, attempt=attempt, step_min=step_min, step_max=step_max, limit=limit, cursor=cursor
        )
    if as_json:
        _echo_json(page)
        return
    table = Table(box=None, pad_edge=False, header_style="bold")
    for col in ("ATTEMPT", "STEP", "KIND", "DETECTOR", "VALUE", "THRESHOLD", "ACTION"):
        table.add_column(col, justify="right" if col in {"ATTEMPT", "STEP", "VALUE", "THRESHOLD"} else "left")
    for a in page.get("data", []):
        table.add_row(
            str(a.get("attempt")), str(a.get("step")), a.get("kind") or "", a.get("detector") or "",
            _num(a.get("value")), _num(a.get("threshold")), a.get("action") or "",
        )
    console = _out()
    console.print(table)
    more = f"; next page: --cursor {page['next']}" if page.get("next") else ""
    console.print(f"{len(page.get('data', []))} of {page.get('count', 0)} anomalies{more}", style="dim",
                  highlight=False)


_SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[Any]) -> str:
    """Unicode sparkline; non-finite points show as '!' so a NaN is visible at a glance."""
    xs = [_f(v) for v in values]
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


@app.command("metrics")
def metrics(
    run_id: RunArg,
    series: Annotated[
        list[str] | None,
        typer.Option("--series", help="loss, grad_norm, grad_norm_clipped, lr, loss_scale or throughput "
                     "(repeatable).", show_default="loss"),
    ] = None,
    max_points: Annotated[
        int | None,
        typer.Option("--max-points", min=2, max=10_000,
                     help="Downsample to this many points, keeping each bucket's min and max "
                     "(default 40; with --json, the server's 1000).", show_default=False),
    ] = None,
    attempt: Annotated[int | None, typer.Option("--attempt", min=1, help="Only this attempt number.",
                                                show_default=False)] = None,
    step_min: Annotated[int | None, typer.Option("--step-min", min=0, show_default=False)] = None,
    step_max: Annotated[int | None, typer.Option("--step-max", min=0, show_default=False)] = None,
    url: UrlOpt = None,
    token: TokenOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """A run's metric series over steps (downsampled so spikes stay visible)."""
    if max_points is None and not as_json:
        max_points = 40
    with _api(url, token) as client:
        body = client.metrics(
            run_id, series=series or ["loss"], max_points=max_points, attempt=attempt, step_min=step_min,
            step_max=step_max,
        )
    if as_json:
        _echo_json(body)
        return
    console = _out()
    for s in body.get("series", []):
        steps, values, atts = s.get("steps") or [], s.get("values") or [], s.get("attempts") or []
        note = f", downsampled from {s.get('total_points')}" if s.get("downsampled") else ""
        console.print(f"{s['name']} ({len(steps)} points{note})", style="bold", highlight=False)
        if not steps:
            continue
        console.print(sparkline(values), highlight=False)
        table = Table(box=None, pad_edge=False, header_style="bold")
        for col in ("ATTEMPT", "STEP", s["name"].upper()):
            table.add_column(col, justify="right")
        fmt = ".3e" if s["name"] == "lr" else ".5g"
        for i, step in enumerate(steps):
            table.add_row(str(atts[i]) if i < len(atts) else "-", str(step), _num(values[i], fmt))
        console.print(table)
