"""Why a worker group failed, in one line: from Ray Train's per-rank failures where it reports them, from the
error text only where no structure exists (a lost channel, a controller error, a train function that never ran).

Ray Train V2's ``WorkerGroupError.worker_failures`` maps each failed rank to its exception; the channel actor
keeps them as plain ``WorkerFailure`` records (``orchestrator.channel``). When one worker died, the others only
report a broken connection, so a dead rank is the cause; otherwise the lowest failed rank's exception.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contracts.wire import SetupConfigError, one_line
from orchestrator.channel import WorkerFailure

DIED = "worker rank {rank} died (its process exited: killed, out of memory or crashed)"


@dataclass(frozen=True)
class Failure:
    """A failed attempt's error: the full text, and the per-rank failures when Ray Train reported them."""

    text: str
    workers: tuple[WorkerFailure, ...] = ()

    @classmethod
    def of_fit(cls, fit: Mapping[str, Any]) -> Failure:
        """From a channel's ``fit`` status (``{"state": "failed", "error": text, "worker_failures": [...]}``)."""
        workers = tuple(WorkerFailure.from_dict(w) for w in fit.get("worker_failures") or [])
        return cls(str(fit.get("error") or ""), workers)

    def config_error(self) -> str | None:
        """The message of a deterministic setup error a rank raised (``SetupConfigError``, after classifying it
        on the worker), or None: a crash. A dead rank makes it a crash whatever the others raised."""
        if any(w.died for w in self.workers):
            return None
        ranked = sorted(self.workers, key=lambda w: w.rank)
        return next((w.message for w in ranked if w.type == SetupConfigError.__name__), None)

    def summary(self) -> str:
        """The root cause in one line."""
        if not self.workers:
            return summarize_error(self.text)
        ranked = sorted(self.workers, key=lambda w: w.rank)
        dead = next((w for w in ranked if w.died), None)
        if dead is not None:
            return DIED.format(rank=dead.rank)
        first = ranked[0]
        return one_line(f"{first.type}: {first.message}" if first.message else first.type)


# ------------------------------------------------------------------------- the text, where no structure exists
_EXC_LINE = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Checkpoint|Crash|Interrupt|Exit)):\s*(.*)$")
_RANK_SNIPPET = re.compile(r"^\[Rank (\d+) Error Snippet\]:\s*$", re.MULTILINE)
_DIED_MARKERS = ("actor died unexpectedly", "worker process has died", "health check failed", "killed by")


def summarize_error(text: str | None) -> str:
    """The root cause of a failed worker group in one line, read from its text: Ray Train's error lists a
    snippet per rank (a dead rank is the cause), else the first rank's (or the text's) exception line."""
    text = str(text or "").strip()
    if not text:
        return "no error recorded"
    parts = _RANK_SNIPPET.split(text)
    snippets = {int(parts[i]): parts[i + 1] for i in range(1, len(parts) - 1, 2)}
    for rank, body in sorted(snippets.items()):
        if any(marker in body for marker in _DIED_MARKERS):
            return DIED.format(rank=rank)
    return _exception_line([snippets[r] for r in sorted(snippets)] or [text]) or one_line(text)


def _exception_line(bodies: Sequence[str]) -> str | None:
    for body in bodies:
        found = [m for m in (_EXC_LINE.match(ln.strip()) for ln in body.splitlines()) if m is not None]
        if found:
            name, msg = found[-1].group(1), found[-1].group(2)
            return one_line(f"{name.rsplit('.', 1)[-1]}: {msg}" if msg else name)
    return None
