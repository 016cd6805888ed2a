"""The worker side of the event channel: an ``EventSink`` that batches events to the run's channel actor.

It must never slow a training step: ``emit`` appends to a list and, every ``flush_interval`` seconds or
``max_batch`` events, sends the batch with a fire-and-forget ``push.remote``; ``should_stop`` returns a cached
flag refreshed in the background (a ``should_stop.remote`` whose result is picked up with ``ray.wait(timeout=0)``).
Only the end of an attempt waits: the ``end`` event and ``request_plan`` make sure every earlier batch reached
the actor, since the worker group may be torn down right after.

The sink numbers events (``seq`` from 1 per attempt), tags them with the attempt and stamps them with the
worker's wall clock (``ts``, for latency measurements; the store does not need it). After ``request_plan``
returns a plan, the sink has already moved to the plan's attempt: later events belong to the new attempt and
count from seq 1 again.

It travels in the ``train_loop_config`` (pickled once per worker): only the actor handle and the settings are
pickled; buffers and in-flight references are rebuilt on the worker.
"""

from __future__ import annotations

import time
from typing import Any

import ray

PLAN_TIMEOUT_S = 120.0
"""How long rank 0 waits for the orchestrator's in-place plan before ending the attempt instead."""
FINAL_FLUSH_TIMEOUT_S = 10.0


class ActorSink:
    """``EventSink`` over a ``orchestrator.channel.RunChannel`` actor handle."""

    DEFAULT_FLUSH_INTERVAL = 0.5
    """Seconds between pushes. Each ``push.remote`` costs the channel actor far more than the events in it (at
    100 attempts, 0.2 s meant 500 pushes a second and ~0.7 of a core in the channels); a metric is visible after
    at most this plus the scheduler's poll interval and its tick, inside the 2 s budget for ingest lag."""
    DEFAULT_MAX_BATCH = 512
    """Events per push at most (a fast loop pushes before the interval is up)."""

    def __init__(
        self,
        handle: Any,
        *,
        attempt: int,
        flush_interval: float = DEFAULT_FLUSH_INTERVAL,
        max_batch: int = DEFAULT_MAX_BATCH,
        stop_poll_interval: float = 0.5,
    ) -> None:
        self.handle = handle
        self.attempt = attempt
        self.flush_interval = flush_interval
        self.max_batch = max_batch
        self.stop_poll_interval = stop_poll_interval
        self._reset_runtime()

    def _reset_runtime(self) -> None:
        self._seq = 0
        self._buffer: list[dict[str, Any]] = []
        self._last_flush = time.monotonic()
        self._in_flight: list[Any] = []
        self._stop = False
        self._stop_ref: Any = None
        self._last_stop_poll = 0.0
        self._registered = False

    def __getstate__(self) -> dict[str, Any]:
        return {
            "handle": self.handle,
            "attempt": self.attempt,
            "flush_interval": self.flush_interval,
            "max_batch": self.max_batch,
            "stop_poll_interval": self.stop_poll_interval,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_runtime()

    # ------------------------------------------------------------------------------------ EventSink
    def emit(self, type: str, data: dict[str, Any]) -> None:
        if not self._registered:
            self._register()
        self._seq += 1
        self._buffer.append({"attempt": self.attempt, "seq": self._seq, "ts": time.time(), "type": type,
                             "data": data})
        if type == "end":
            self._flush_and_wait(FINAL_FLUSH_TIMEOUT_S)
        elif len(self._buffer) >= self.max_batch or time.monotonic() - self._last_flush >= self.flush_interval:
            self.flush()

    def flush(self) -> None:
        """Send the buffered events (does not wait for delivery)."""
        self._last_flush = time.monotonic()
        if self._buffer:
            batch, self._buffer = self._buffer, []
            self._in_flight.append(self.handle.push.remote(batch))
        if len(self._in_flight) > 8:
            _, self._in_flight = ray.wait(self._in_flight, num_returns=len(self._in_flight), timeout=0)

    def should_stop(self) -> bool:
        if self._stop:
            return True
        now = time.monotonic()
        if now - self._last_stop_poll < self.stop_poll_interval:
            return False
        self._last_stop_poll = now
        if self._stop_ref is not None:
            ready, _ = ray.wait([self._stop_ref], timeout=0)
            if not ready:
                return False
            try:
                self._stop = bool(ray.get(ready[0]))
            except ray.exceptions.RayError:
                # the channel is gone: the control plane has given up on this worker group
                self._stop = True
            self._stop_ref = None
        if not self._stop:
            self._stop_ref = self.handle.should_stop.remote()
        return self._stop

    def _register(self) -> None:
        """Tell the channel which placement group holds this worker group, so a forced stop can free it
        (Ray Train's own cleaner needs the dashboard's state API, which a lean cluster may not run)."""
        self._registered = True
        try:
            pg = ray.util.get_current_placement_group()
        except Exception:  # noqa: BLE001 - outside a placement group (plain tests): nothing to register
            pg = None
        self.handle.register_worker.remote({"placement_group": pg, "attempt": self.attempt})

    # ------------------------------------------------------------------------------ in-place recovery
    def request_plan(self, end_data: dict[str, Any], timeout: float = PLAN_TIMEOUT_S) -> dict[str, Any] | None:
        """Rank 0 of a diverged attempt: ask the orchestrator for an in-place plan and wait for its answer.

        Returns the plan (``{"attempt": n, "spec": AttemptSpec dict, "reason": str}``), after which this sink
        emits as attempt ``n``; or None (no plan in time, a stop request, or the policy wants a full restart or
        gives up): end the attempt normally.
        """
        self._flush_and_wait(FINAL_FLUSH_TIMEOUT_S)
        try:
            ray.get(self.handle.request_plan.remote(self.attempt, end_data), timeout=FINAL_FLUSH_TIMEOUT_S)
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                answer = ray.get(self.handle.get_plan.remote(self.attempt), timeout=FINAL_FLUSH_TIMEOUT_S)
                if answer.get("answered"):
                    plan: dict[str, Any] | None = answer.get("plan")
                    if plan is not None:
                        self.attempt = int(plan["attempt"])
                        self._seq = 0
                    return plan
                time.sleep(0.1)
        except ray.exceptions.RayError:
            return None
        return None

    def _flush_and_wait(self, timeout: float) -> None:
        self.flush()
        if self._in_flight:
            ray.wait(self._in_flight, num_returns=len(self._in_flight), timeout=timeout)
            self._in_flight = []
