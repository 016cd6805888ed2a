"""Following a run live (``submit --watch``, ``runs watch``, ``runs retry --watch``).

The watch polls the API (run, attempts, new anomalies, newest metrics) every half second: simpler and more
robust than the event stream (it survives a server restart), and the store is what the user wants to see
anyway. ``Tracker`` turns successive polls into events for a ``View``: on a terminal a live panel
(``LiveView``); elsewhere (CI logs, pipes) one plain line per event (``PlainView``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import typer
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table
from rich.text import Text

from api.cli.options import connect, console, echo_json
from api.cli.render import anomaly_line, failed_as, number, outcome_text, state_style
from api.client import ApiError, BallastClient, ClientError
from orchestrator.policy.states import TERMINAL_ATTEMPT_STATES, TERMINAL_RUN_STATES

TERMINAL = frozenset(s.value for s in TERMINAL_RUN_STATES)
TERMINAL_ATTEMPT = frozenset(s.value for s in TERMINAL_ATTEMPT_STATES)
EXIT_INTERRUPTED = 130


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
        f"attempt {snap.attempt} step {snap.step}{total} loss {number(snap.loss)} "
        f"grad_norm {number(snap.grad_norm)} lr {number(snap.lr, '.3g')}"
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
            (f"run {s.run_id} ", "bold"), (s.name, "cyan"), "  ", (s.state.upper(), state_style(s.state)),
            f"   attempt {s.attempt or '-'}", f" ({s.attempt_state})" if s.attempt_state else "",
            f"   retries {s.retries}   anomalies {s.anomalies}",
        )
        grid = Table.grid(padding=(0, 3))
        grid.add_row(f"loss {number(s.loss)}", f"grad norm {number(s.grad_norm)}", f"lr {number(s.lr, '.3g')}")
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


class Tracker:
    """Turns successive polls of the API into view events: run state changes, attempts starting and ending
    (with the recovery reason of each retry), new anomalies, and the newest metrics."""

    def __init__(self, client: BallastClient, run_id: int, view: View) -> None:
        self.client, self.run_id, self.view = client, run_id, view
        self.snap = Snapshot(run_id=run_id)
        self._attempt_states: dict[int, str] = {}
        self._reasons: dict[int, str] = {}
        """Each retry's reason as shown; its LR probe's result is appended to it later (``_probe``)."""
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
        self.view.event(f"run {run['id']} ({run['name']}): {state}{why}", state_style(state))

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
                self._reasons[n] = str(att["reason"])
        self._probe(n, att)
        if prev is None or prev not in TERMINAL_ATTEMPT:
            # an attempt that just ended gets one last look, so nothing it reported is missed
            self._new_anomalies(n)
            self._metrics(n)
            if n == s.attempt:
                self.view.update(s)  # progress before the attempt's end line
        if state in TERMINAL_ATTEMPT and prev not in TERMINAL_ATTEMPT:
            at = f" (last step {att['last_step']})" if att.get("last_step") is not None else ""
            why = outcome_text(att)
            style = "green" if state == "succeeded" else "red"
            self.view.event(f"attempt {n} {state}{at}" + (f": {why}" if why else ""), style)
        self._attempt_states[n] = state
        if n == s.attempt:
            s.attempt_state = state

    def _probe(self, n: int, att: dict[str, Any]) -> None:
        """Once a retry's LR probe has chosen (after the retry started), what it chose: the part its reason gained."""
        shown = self._reasons.get(n)
        probe = (att.get("plan") or {}).get("lr_probe") or {}
        if shown is None or probe.get("chosen") is None:
            return
        reason = str(att.get("reason") or "")
        if reason != shown:
            self.view.event(f"lr probe: {reason.removeprefix(shown).removeprefix('; ')}", "bold yellow")
        del self._reasons[n]  # shown, in the recovery line or here

    def _new_anomalies(self, n: int) -> None:
        # within an attempt anomalies come in step order, so asking from the newest step seen keeps pages small
        rows = self.client.all_anomalies(self.run_id, attempt=n, step_min=self._anomaly_step.get(n))
        for a in rows:
            if int(a["id"]) in self._seen_anomalies:
                continue
            self._seen_anomalies.add(int(a["id"]))
            self._anomaly_step[n] = max(self._anomaly_step.get(n, 0), int(a["step"]))
            line = anomaly_line(a)
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


def _follow(tracker: Tracker, view: View, *, interval: float, patience: float) -> dict[str, Any]:
    """Poll until the run is finished and return it. A server restarting (crash recovery) or a database blip
    does not end the watch; a server that stays away for ``patience`` seconds, or any refusal (404, 401, ...),
    does (the ClientError propagates)."""
    lost_since: float | None = None
    while True:
        try:
            run = tracker.poll()
        except ClientError as exc:
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
        if lost_since is not None:
            view.event("connection to the server restored")
        lost_since = None
        if run["state"] in TERMINAL:
            return run
        time.sleep(interval)


def _closing_line(run: dict[str, Any]) -> str:
    """``run 7 SUCCEEDED (2 attempts, 1 retry, best loss 1.2)`` and, unless it succeeded, the reason."""
    state = run["state"]
    summary = run.get("summary") or {}
    n = run.get("current_attempt") or 0
    retries = int(summary.get("retries_used") or 0)
    tail = f"{n} attempt{'s' if n != 1 else ''}, {retries} retr{'ies' if retries != 1 else 'y'}"
    if summary.get("best_loss") is not None:
        tail += f", best loss {number(summary['best_loss'])}"
    reason = f": {run['reason']}" if run.get("reason") and state != "succeeded" else ""
    return f"run {run['id']} {state.upper()}{failed_as(run)} ({tail}){reason}"


def watch(
    url: str | None,
    token: str | None,
    run_id: int,
    *,
    as_json: bool = False,
    interval: float = 0.5,
    patience: float = 60.0,
) -> int:
    """Follow a run to its end; the exit code is 0 if it succeeded, 1 if it failed or was cancelled (130 when
    the watch itself is interrupted: the run goes on)."""
    out = console()
    view: View
    if as_json:
        view = PlainView(echo=lambda _line: None)
    elif out.is_terminal:
        view = LiveView(out)
    else:
        view = PlainView()
    with connect(url, token) as client:
        try:
            run = _follow(Tracker(client, run_id, view), view, interval=interval, patience=patience)
        except KeyboardInterrupt:
            view.close()
            typer.echo(f"stopped watching; run {run_id} continues (`ballast runs cancel {run_id}` stops it)",
                       err=True)
            return EXIT_INTERRUPTED
        finally:
            view.close()
    if as_json:
        echo_json(run)
    else:
        out.print(_closing_line(run), style=state_style(run["state"]), highlight=False)
    return 0 if run["state"] == "succeeded" else 1
