"""A database outage, logged as an operator wants to read it: the scheduler's ticks fail until the database is back
(training goes on; the channels buffer the events), and each failed tick is one line, never a traceback.

- the first failed tick: a warning with the cause (the driver's first line: "connection refused", "database ... is
  not accepting connections");
- the repeats: one line each at debug level, and a warning at most every ``REPEAT_WARNING_S`` saying how long it
  has lasted;
- the first tick that succeeds again: one info line with the outage's length and failed ticks.

Anything that is not an outage (a bug) keeps its traceback: that is what it is for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import sqlalchemy.exc as sa_exc

from contracts.wire import one_line

REPEAT_WARNING_S = 60.0
"""How often a continuing outage is repeated at warning level."""
OUTAGE_ERRORS = (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, sa_exc.TimeoutError)
"""What a database that cannot be reached (down, refusing connections, its connections dropped) raises."""


def is_outage(exc: BaseException) -> bool:
    """The database cannot be reached (rather than a query that is wrong)."""
    if isinstance(exc, OUTAGE_ERRORS):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and bool(exc.connection_invalidated)


def cause(exc: BaseException) -> str:
    """The driver's own words, one line (SQLAlchemy's wrapper adds the statement and a link)."""
    orig = getattr(exc, "orig", None)
    return one_line(orig if orig is not None else exc, 300, empty=type(exc).__name__)


class OutageLog:
    """Tracks one outage at a time: ``failed(exc)`` for each failed tick, ``succeeded()`` after each good one."""

    def __init__(self, log: logging.Logger, clock: Callable[[], float] = time.monotonic) -> None:
        self.log = log
        self.clock = clock
        self.failures = 0
        self.since: float | None = None
        self._warned_at = 0.0

    def failed(self, exc: BaseException) -> None:
        now = self.clock()
        self.failures += 1
        if self.since is None:
            self.since = self._warned_at = now
            self.log.warning("scheduler: the database is unreachable (%s); retrying every tick", cause(exc))
        elif now - self._warned_at >= REPEAT_WARNING_S:
            self._warned_at = now
            self.log.warning("scheduler: the database is still unreachable after %.0f s (%d failed ticks): %s",
                             now - self.since, self.failures, cause(exc))
        else:
            self.log.debug("scheduler: tick failed, the database is unreachable: %s", cause(exc))

    def succeeded(self) -> None:
        if self.since is None:
            return
        self.log.info("scheduler: the database is reachable again after %.0f s (%d failed ticks)",
                      self.clock() - self.since, self.failures)
        self.failures, self.since = 0, None
