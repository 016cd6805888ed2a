"""The one SIGINT/SIGTERM installer for a foreground scheduler (``ballast scheduler``, ``python -m
orchestrator.scheduler``): the first signal stops the loop after its current tick, a second one stops waiting."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType


@contextmanager
def stop_on_signals(stop: Callable[[], None]) -> Iterator[None]:
    """Within the block SIGINT/SIGTERM call ``stop`` (it sets an event; the loop notices within one poll period);
    a second signal raises ``SystemExit(1)``. The previous handlers are restored on exit."""
    stopping = threading.Event()

    def _stop(signum: int, _frame: FrameType | None) -> None:
        if stopping.is_set():
            raise SystemExit(1)
        stopping.set()
        stop()

    previous = {sig: signal.signal(sig, _stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def reclaim_signals() -> None:
    """Put this process's own SIGINT/SIGTERM handlers back in charge after Ray connected (main thread only).

    Ray's core worker installs a C-level failure handler for SIGTERM when it connects, from whichever thread; it
    prints a C++ stack dump ("*** SIGTERM received ...") before passing the signal on. Registering the Python
    handlers again replaces it, so an ordinary ``kill`` is an ordinary, quiet stop."""
    if threading.current_thread() is not threading.main_thread():
        return
    for sig in (signal.SIGINT, signal.SIGTERM):
        handler = signal.getsignal(sig)
        if handler is not None:
            signal.signal(sig, handler)
