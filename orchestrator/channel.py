"""The per-worker-group event channel: a detached Ray actor that workers report to and the scheduler drains.

One ``RunChannel`` actor serves one worker group (one ``TorchTrainer.fit``), which may carry several attempts
when numeric rollbacks are applied in place. It works across machines (workers reach it by handle, not through a
filesystem) and it also *runs* the ``fit`` in a thread of its own, so the Ray work belongs to a detached actor
rather than to the scheduler process: a scheduler that dies and restarts finds the actor again by name
(``ray.get_actor(name, namespace=NAMESPACE)``) and carries on draining it. Killing the actor ends the whole
worker group (the Train controller it created, and the controller's workers, share its fate).

The actor is synchronous and single-threaded on purpose: Ray runs a sync actor's calls from one caller in
submission order, so the batches rank 0 pushes arrive in ``seq`` order. Events are ``{"attempt", "seq", "type",
"data"}``; the scheduler passes back what it has committed (``acked = {attempt: last_seq}``) and the actor
drops those, so an event is delivered until the store has it — and the store's unique keys absorb a redelivery.

The in-place recovery handshake: rank 0 of a diverged attempt calls ``request_plan(attempt, end)`` and then
polls ``get_plan(attempt)``; the scheduler sees the request in ``poll()``, records the decision and calls
``answer_plan(attempt, plan_or_None)``. ``None`` means "end the attempt; the scheduler restarts or gives up".

Before the fit, when the launch asks for it (a run's first attempt, a manual retry), the channel runs the
**preflight probe** (:func:`run_preflight`): ``workers.preflight.probe`` as a small Ray task (one CPU at most,
``max_calls=1`` so its process and what it imported go away with it) that builds rank 0's data and model and runs
one forward. It has finished before the ``TorchTrainer`` is built, so it never holds what the worker group needs.
A config error it finds ends the fit at once (``{"state": "failed", "config_error": message}``) without starting
a trainer; a probe that times out or fails for another reason is inconclusive and the fit goes ahead. Its result
is in the fit status as ``preflight`` (``status``, ``seconds``, ``error``).

A **standby** channel (``start_standby``) starts its worker group before any run needs it: one worker, with
``workers.entry:standby_loop_per_worker`` as the train function, which imports everything a run needs and then waits
for ``take_launch``. ``adopt(run_id, attempt, launch)`` hands it a run's launch: the waiting worker takes it and runs
the attempt as a freshly started group would, minus the three cold process starts (this actor, the Train controller,
the worker) that are most of a run's start-up (``BENCHMARKS.md``, start latency). A standby serves one run, then
ends with it.

When the fit fails, the channel keeps the error as text and, when Ray Train reports per-rank failures
(``ray.train.WorkerGroupError.worker_failures``: rank → exception), also as plain :class:`WorkerFailure`
records, so the scheduler summarises a crash from structure rather than from the text
(``orchestrator.scheduler.failures``).
"""

from __future__ import annotations

import importlib
import os
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from contracts.wire import one_line

NAMESPACE = "ballast"
"""Ray namespace of the channel actors (named, detached)."""
MAX_BUFFERED_EVENTS = 200_000
"""Beyond this many undelivered events (no scheduler for a long while) the oldest metric events are dropped;
anomalies, checkpoints and outcomes are always kept."""
MAX_ERROR_CHARS = 8000
MAX_FAILURE_MESSAGE_CHARS = 2000
CONTROLLER_POLL_S = "0.25"
"""Ray Train V2's controller polls its workers every ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S`` (default 2 s). The
workers no longer call ``ray.train.report`` (whose wait for the controller once stalled every checkpoint), but
the poll still bounds how soon the controller sees a finished or failed worker group: 4x a second costs it little
(an operator's own setting of the variable wins)."""
DEFAULT_TRAIN_FN = "workers.entry:train_loop_per_worker"
"""The per-worker entry; a launch may name another (set by the scheduler, never by a recipe)."""
STANDBY_TRAIN_FN = "workers.entry:standby_loop_per_worker"
"""The train function of a standby worker group: warm up, wait for ``take_launch``, then run the launch."""
DEFAULT_STEP_TIMEOUT_S = 600.0


def collective_timeout_s(step_timeout_s: float) -> int:
    """The process group's timeout (``TorchConfig.timeout_s``: rendezvous and every collective) for an attempt
    with this step-progress deadline: the deadline plus a margin (a minute, or the deadline again if longer), so
    the scheduler's deadline fires first and names the hang, and the collective timeout is the backstop that ends
    a stuck group when no scheduler watches."""
    return int(step_timeout_s + max(60.0, step_timeout_s))


def step_timeout_of(launch: Mapping[str, Any]) -> float:
    """``resources.step_timeout_s`` of the launch's recipe (the recipe as the ``AttemptSpec`` dict carries it)."""
    resources = ((launch.get("spec") or {}).get("recipe") or {}).get("resources") or {}
    return float(resources.get("step_timeout_s") or DEFAULT_STEP_TIMEOUT_S)


@dataclass(frozen=True)
class WorkerFailure:
    """One rank's failure, as plain values (the ``fit`` status carries them as dicts: ``to_dict``/``from_dict``)."""

    rank: int
    type: str
    """The exception's class name."""
    message: str
    died: bool
    """The worker process is gone (Ray Train's failed health check, or the actor died), not an error it raised."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> WorkerFailure:
        return cls(rank=int(data["rank"]), type=str(data["type"]), message=str(data.get("message") or ""),
                   died=bool(data.get("died", False)))


def worker_failures(exc: BaseException) -> list[WorkerFailure]:
    """Ray Train's per-rank failures of a failed fit (``WorkerGroupError.worker_failures``), by rank; empty when
    the error has no such structure (a controller error, a bad train function, anything else)."""
    per_rank = getattr(exc, "worker_failures", None)
    if not isinstance(per_rank, Mapping):
        return []
    out = []
    for rank, err in sorted(per_rank.items(), key=lambda kv: int(kv[0])):
        message = str(err).strip()
        if len(message) > MAX_FAILURE_MESSAGE_CHARS:
            message = message[: MAX_FAILURE_MESSAGE_CHARS - 1] + "…"
        out.append(WorkerFailure(rank=int(rank), type=type(err).__name__, message=message, died=_died(err)))
    return out


def _died(err: object) -> bool:
    # a dead worker reaches Ray Train as a failed health check (``WorkerHealthCheckFailedError``, internal to Ray)
    # wrapping the actor's death; the attribute is what marks it
    if isinstance(getattr(err, "health_check_failure", None), BaseException):
        return True
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # pragma: no cover - the channel runs inside Ray
        return False
    return isinstance(err, RayActorError)


class RunChannel:
    """Plain class (unit-testable without Ray); ``channel_actor_class()`` wraps it as the Ray actor."""

    def __init__(self, run_id: int, first_attempt: int, owner: str | None = None) -> None:
        self.run_id = run_id
        self.first_attempt = first_attempt
        self.owner = owner
        """A standby's scheduler (``host:pid:nonce``), so a restarted one can tell its predecessor's idle standbys."""
        self._launch: dict[str, Any] | None = None
        """A standby's adopted launch, until its worker takes it."""
        self._adopted = False
        self._touched = time.monotonic()
        """When a standby's scheduler last asked after it (``touch``): an idle standby nobody touches is orphaned."""
        self._events: list[dict[str, Any]] = []
        self._stop = False
        self._plan_requests: dict[int, dict[str, Any]] = {}
        self._plan_answers: dict[int, dict[str, Any] | None] = {}
        self._fit: dict[str, Any] = {"state": "idle", "error": None}
        self._thread: threading.Thread | None = None
        self._dropped_metrics = 0
        self._placement_groups: list[Any] = []
        self._marks: dict[str, float] = {"channel_up": time.time()}

    # ----------------------------------------------------------------------------------- worker side
    def push(self, batch: list[dict[str, Any]]) -> None:
        """Fire-and-forget from rank 0's sink."""
        self._events.extend(batch)
        if len(self._events) > MAX_BUFFERED_EVENTS:
            excess = len(self._events) - MAX_BUFFERED_EVENTS
            kept: list[dict[str, Any]] = []
            for ev in self._events:
                if excess > 0 and ev.get("type") == "metric":
                    excess -= 1
                    self._dropped_metrics += 1
                    continue
                kept.append(ev)
            self._events = kept

    def should_stop(self) -> bool:
        return self._stop

    def register_worker(self, info: Mapping[str, Any]) -> None:
        """Rank 0's first call: the placement group of its worker group (freed on a forced stop)."""
        pg = info.get("placement_group")
        if pg is not None and all(p.id != pg.id for p in self._placement_groups):
            self._placement_groups.append(pg)

    def add_marks(self, marks: Mapping[str, float]) -> None:
        """Fire-and-forget from rank 0: start-up timing marks (wall-clock seconds), kept once per name."""
        for name, ts in marks.items():
            self._marks.setdefault(str(name), float(ts))

    def take_launch(self) -> dict[str, Any] | None:
        """A standby worker's poll: the launch it was adopted for (once), else None (keep waiting). A standby
        nobody adopts is killed, never asked to stop: a kill frees its CPU at once."""
        launch, self._launch = self._launch, None
        return launch

    def request_plan(self, attempt: int, end: Mapping[str, Any]) -> None:
        """Rank 0 of a diverged attempt asks for an in-place plan (then polls ``get_plan``)."""
        self._plan_requests[attempt] = {"attempt": attempt, "end": dict(end)}

    def get_plan(self, attempt: int) -> dict[str, Any]:
        """``{"answered": bool, "plan": dict | None}``; a stop request answers None (no new attempt)."""
        if attempt in self._plan_answers:
            return {"answered": True, "plan": self._plan_answers[attempt]}
        if self._stop:
            return {"answered": True, "plan": None}
        return {"answered": False, "plan": None}

    # -------------------------------------------------------------------------------- scheduler side
    def ping(self) -> dict[str, Any]:
        return {"run_id": self.run_id, "first_attempt": self.first_attempt, "fit": dict(self._fit)}

    def drain(self, acked: Mapping[int, int] | None = None) -> list[dict[str, Any]]:
        """Undelivered events, oldest first. Events at or below ``acked[attempt]`` are committed: dropped."""
        if acked:
            self._events = [e for e in self._events if int(e.get("seq", 0)) > acked.get(int(e["attempt"]), 0)]
        return list(self._events)

    def poll(self, acked: Mapping[int, int] | None = None) -> dict[str, Any]:
        """Everything the scheduler needs per tick in one call: events, open plan requests, the fit's state."""
        events = self.drain(acked)
        open_requests = [r for a, r in sorted(self._plan_requests.items()) if a not in self._plan_answers]
        return {
            "events": events,
            "plan_requests": open_requests,
            "fit": dict(self._fit),
            "stop": self._stop,
            "dropped_metrics": self._dropped_metrics,
            "marks": dict(self._marks),
        }

    def request_stop(self) -> None:
        self._stop = True

    def answer_plan(self, attempt: int, plan: dict[str, Any] | None) -> None:
        self._plan_answers[attempt] = plan

    def fit_status(self) -> dict[str, Any]:
        return dict(self._fit)

    def standby_state(self) -> dict[str, Any]:
        """Whether this is a standby whose worker is waiting (``ready``), whether a run has adopted it, its
        scheduler, and how long since that scheduler last touched it."""
        return {"ready": "standby_ready" in self._marks and self._fit.get("state") == "running",
                "adopted": self._adopted, "owner": self.owner, "untouched_s": time.monotonic() - self._touched}

    def touch(self) -> dict[str, Any]:
        """A standby's scheduler, every tick: still wanted. Returns the fit's state and the worker group's
        placement groups (the scheduler keeps them, to free them even if this actor dies)."""
        self._touched = time.monotonic()
        return {"fit": dict(self._fit), "placement_groups": list(self._placement_groups)}

    def adopt(self, run_id: int, attempt: int, launch: dict[str, Any]) -> None:
        """Hand this standby's waiting worker a run's launch; from now on the channel is that run's."""
        if self._adopted:
            raise RuntimeError(f"standby channel already adopted by run {self.run_id}")
        self.run_id, self.first_attempt, self._adopted = run_id, attempt, True
        self._marks["adopted"] = time.time()
        self._launch = dict(launch)

    def marks(self) -> dict[str, float]:
        """The worker group's start-up timing marks, wall-clock seconds by name (``benchmarks/bench_start.py``
        lists them): the channel's own and rank 0's (``workers.entry.start_marker``). Also in every ``poll``."""
        return dict(self._marks)

    def placement_groups(self) -> list[Any]:
        return list(self._placement_groups)

    # ------------------------------------------------------------------------------------ the fit
    def start(self, launch: dict[str, Any]) -> None:
        """Run the worker group's ``TorchTrainer.fit`` in a thread of this actor (returns at once)."""
        self._start(launch)

    def start_standby(self, template: dict[str, Any]) -> None:
        """Start a standby worker group from ``template`` (a launch without a run: resources and storage); its
        worker waits for ``adopt``."""
        self._start({**template, "train_fn": STANDBY_TRAIN_FN, "standby": True})

    def _start(self, launch: dict[str, Any]) -> None:
        if self._thread is not None:
            raise RuntimeError(f"run {self.run_id}: this channel already started its worker group")
        self._fit = {"state": "running", "error": None, "started": time.time()}
        handle = self._self_handle()
        self._thread = threading.Thread(
            target=self._run_fit, args=(launch, handle), name="ballast-fit", daemon=True
        )
        self._thread.start()

    def _run_fit(self, launch: dict[str, Any], handle: Any) -> None:
        self._marks.setdefault("fit_thread", time.time())
        if launch.get("preflight"):
            self._marks.setdefault("preflight_start", time.time())
            # the probe runs in a process of its own: import what the trainer needs meanwhile (nothing is built)
            threading.Thread(target=import_trainer, args=(launch,), name="ballast-imports", daemon=True).start()
            try:
                result = run_preflight(launch)
            except Exception as exc:  # noqa: BLE001 - a broken probe must never keep the fit from starting
                result = {"status": PREFLIGHT_INCONCLUSIVE, "seconds": None, "error": _format_error(exc)}
            self._fit = {**self._fit, "preflight": result}
            self._marks.setdefault("preflight_done", time.time())
            if result["status"] == PREFLIGHT_CONFIG_ERROR:
                self._fit = {"state": "failed", "error": result["error"], "config_error": result["error"],
                             "stage": "preflight", "preflight": result, "ended": time.time()}
                return
        preflight = self._fit.get("preflight")
        try:
            run_torch_trainer(launch, handle)
        except BaseException as exc:  # noqa: BLE001 - every failure must reach the scheduler as plain data
            self._fit = {"state": "failed", "error": _format_error(exc), "ended": time.time(),
                         "worker_failures": [f.to_dict() for f in worker_failures(exc)]}
        else:
            self._fit = {"state": "done", "error": None, "ended": time.time()}
        if preflight is not None:
            self._fit["preflight"] = preflight

    def _self_handle(self) -> Any:
        import ray

        return ray.get_runtime_context().current_actor


def _format_error(exc: BaseException) -> str:
    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    if len(text) > MAX_ERROR_CHARS:
        text = text[: MAX_ERROR_CHARS // 2] + "\n…\n" + text[-MAX_ERROR_CHARS // 2 :]
    return text


PREFLIGHT_OK, PREFLIGHT_CONFIG_ERROR, PREFLIGHT_INCONCLUSIVE = "ok", "config_error", "inconclusive"
"""A preflight's ``status``: the setup works; a deterministic setup error (the run fails); the probe itself
failed or timed out (not the recipe's fault: the attempt starts anyway)."""


def run_preflight(launch: Mapping[str, Any]) -> dict[str, Any]:
    """The preflight probe for ``launch`` as a Ray task; never raises. ``{"status", "seconds", "error"}``.

    The task inherits this actor's ``runtime_env`` (the recipe's ``code``), so it imports what the workers will."""
    import ray

    from workers.preflight import probe

    options = dict(launch.get("preflight") or {})
    timeout = float(options.get("timeout_s") or 300.0)
    started = time.monotonic()
    ref = None
    try:
        task = ray.remote(num_cpus=float(options.get("num_cpus", 1.0)), max_calls=1, max_retries=0)(probe)
        ref = task.remote(dict(launch["spec"]), int(launch["num_workers"]))
        result: dict[str, Any] = ray.get(ref, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        if ref is not None:
            ray.cancel(ref, force=True)
        result = {"status": PREFLIGHT_INCONCLUSIVE, "error": f"the probe did not finish within {timeout:g} s"}
    except Exception as exc:  # noqa: BLE001 - Ray could not run the probe: not the recipe's fault
        result = {"status": PREFLIGHT_INCONCLUSIVE,
                  "error": f"the probe could not run: {type(exc).__name__}: {one_line(exc, 500)}"}
    return {"status": result["status"], "seconds": round(time.monotonic() - started, 3),
            "error": result.get("error")}


def import_trainer(launch: Mapping[str, Any]) -> Any:
    """Import Ray Train's ``TorchTrainer`` and the launch's train function (torch with them); returns the function.
    The channel does it while the preflight probe runs, so the trainer's start does not wait for the imports; never
    raises there (the trainer's own import reports a failure)."""
    try:
        import ray.train.torch  # noqa: F401 - the import is the point

        module, _, func = str(launch.get("train_fn") or DEFAULT_TRAIN_FN).partition(":")
        return getattr(importlib.import_module(module), func)
    except Exception:  # noqa: BLE001 - run_torch_trainer imports again and fails the fit with the error
        return None


def _mark(channel: Any, name: str) -> None:
    """A start-up timing mark on ``channel`` (this actor, from its fit thread: fire-and-forget)."""
    add = getattr(channel, "add_marks", None)
    if add is not None:
        add.remote({name: time.time()})


def run_torch_trainer(launch: Mapping[str, Any], channel: Any) -> None:
    """One worker group: a Ray Train ``TorchTrainer`` for ``launch`` (built by the scheduler), reporting to
    ``channel``. Ray Train's own retries are off: a failure is an attempt outcome the recovery policy handles.
    Marks ``train_imported`` and ``fit_called`` on the channel."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from contracts.storage import StorageOptions, local_dir
    from workers.entry import worker_config

    module, _, func = str(launch.get("train_fn") or DEFAULT_TRAIN_FN).partition(":")
    train_loop_per_worker = getattr(importlib.import_module(module), func)
    _mark(channel, "train_imported")

    # an object-store root: Ray Train keeps its own files there through the filesystem Ballast's workers write
    # checkpoints with (rank 0 writes them itself, workers/checkpointing.py)
    storage_path, storage_fs = str(launch["storage_path"]), None
    if local_dir(storage_path) is None:
        storage_fs, storage_path = StorageOptions.from_dict(launch.get("storage")).filesystem(storage_path)
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", CONTROLLER_POLL_S)  # propagated to the controller
    resources: dict[str, float] = {"CPU": float(launch["cpus_per_worker"])}
    if launch.get("use_gpu"):
        resources["GPU"] = float(launch.get("gpus_per_worker") or 1.0)
    # a standby's worker builds its config from the launch it is adopted for
    config = {"marks": channel} if launch.get("standby") else worker_config(launch, channel)
    trainer = TorchTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        torch_config=TorchConfig(timeout_s=collective_timeout_s(step_timeout_of(launch))),
        scaling_config=ScalingConfig(
            num_workers=int(launch["num_workers"]),
            use_gpu=bool(launch.get("use_gpu")),
            resources_per_worker=resources,
        ),
        run_config=RunConfig(
            name=str(launch["run_name"]),
            storage_path=storage_path,
            storage_filesystem=storage_fs,
            failure_config=FailureConfig(max_failures=0),
        ),
    )
    _mark(channel, "fit_called")
    trainer.fit()


def channel_actor_class() -> Any:
    """``RunChannel`` as a Ray actor class (imported lazily: the store and API never need Ray)."""
    import ray

    return ray.remote(num_cpus=0, max_restarts=0)(RunChannel)  # sync, one thread: ordered calls
