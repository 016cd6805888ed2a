"""How the scheduler reaches the compute: the ``Launcher`` protocol, and ``RayLauncher``, which runs each worker
group as a ``RunChannel`` actor (``orchestrator.channel``: detached, named in the ``ballast`` namespace) on Ray.
The fast scheduler tests put a scripted launcher in its place.

**Standby worker groups** (``Settings.standby_worker_groups``, off by default): a worker group's start is three
cold processes in series (the channel actor, Ray Train's controller, the worker), each importing torch and Ray
Train: 10-30 s on a quiet 2-core machine, most of a short run. ``RayLauncher`` can keep worker groups of the common
shape (``fits_standby``: one worker of ``standby_cpus`` CPUs, no GPU, no ``code``, no preflight) started ahead of
demand, their worker waiting with everything imported. A claim that fits takes one (``standby_for``: its name is
what the attempt records, so a restarted scheduler finds the run's channel as for any other), and the launch hands
the run to it (``RunChannel.adopt``); a standby serves one run and ends with it, and ``keep_standby`` starts the
next one while the cluster has CPUs to spare. Their CPUs count as free for claims: a launch that needs them retires
standbys first. A standby whose scheduler is gone (a process of this host that exited, or no touch from any
scheduler for ``ORPHAN_S``) is retired by the next scheduler that looks. The cost: ``standby_cpus`` per standby
held idle, and a Ray Train run directory per standby named after it rather than after the run (Ballast's own
checkpoints still go under the run's name)."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any, Protocol

from contracts.wire import one_line
from orchestrator.channel import NAMESPACE, channel_actor_class
from orchestrator.settings import Settings

log = logging.getLogger("ballast.scheduler")


class ChannelLost(Exception):
    """The run's channel actor (and with it the worker group) is gone."""


class UnsharedCheckpointRoot(RuntimeError):
    """A local checkpoint root on a Ray cluster of several nodes, not declared shared: refused before launch."""


def alive_nodes() -> int:
    """Ray nodes alive now (the head counts: it may run workers too)."""
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return sum(1 for n in nodes if n.get("Alive"))


class Launcher(Protocol):
    """How the scheduler reaches the compute: Ray in production; a fake in the fast scheduler tests."""

    def connect(self) -> None: ...

    def shutdown(self) -> None: ...

    def free_cpus(self) -> float | None: ...

    def capacity(self) -> dict[str, float] | None: ...

    def launch(self, *, name: str, run_id: int, attempt: int, launch: dict[str, Any]) -> Any: ...

    def attach(self, name: str) -> Any | None: ...

    def poll(self, handle: Any, acked: Mapping[int, int]) -> dict[str, Any] | None: ...

    def request_stop(self, handle: Any) -> None: ...

    def answer_plan(self, handle: Any, attempt: int, plan: dict[str, Any] | None) -> None: ...

    def kill(self, handle: Any) -> None: ...

    def standby_for(self, launch: Mapping[str, Any]) -> str | None:
        """Reserve a ready standby worker group that can run ``launch``; its channel's name (None: start one)."""
        ...

    def keep_standby(self, template: Mapping[str, Any], free_cpus: float | None) -> None:
        """Start standby worker groups from ``template`` up to the configured number, within ``free_cpus``."""
        ...


STANDBY_PREFIX = "ballast-standby-"
"""Channel names of standby worker groups (an adopted one keeps its name: the attempt records it)."""


def fits_standby(launch: Mapping[str, Any], template: Mapping[str, Any]) -> bool:
    """Whether a standby started from ``template`` can run ``launch``: the same single worker of the same CPUs, no
    GPU, the same storage, and nothing the standby's processes were not started with (a ``code`` runtime env, a
    preflight probe before the workers, another train function)."""
    return (int(launch["num_workers"]) == 1 and not launch.get("use_gpu") and not launch.get("runtime_env")
            and not launch.get("preflight") and not launch.get("train_fn")
            and float(launch["cpus_per_worker"]) == float(template["cpus_per_worker"])
            and launch.get("storage_path") == template.get("storage_path")
            and launch.get("storage") == template.get("storage"))


class RayLauncher:
    """Worker groups as ``RunChannel`` actors (detached, named in the ``ballast`` namespace) on Ray."""

    ORPHAN_S = 120.0
    """An idle standby that no scheduler has touched for this long is orphaned (its scheduler touches it every
    tick)."""
    ORPHAN_SCAN_S = 60.0
    """How often a scheduler that keeps standbys looks for orphaned ones."""
    RETIRE_WAIT_S = 60.0
    """How long retiring a standby that is still starting waits for it to register its placement group."""

    def __init__(self, settings: Settings, owner: str | None = None) -> None:
        self.settings = settings
        self.owner = owner
        """The scheduler's id (``host:pid:nonce``), recorded on its standbys."""
        self._owns_ray = False
        self._standbys: dict[str, Any] = {}
        """Standby channels started and not yet handed to a run, by name."""
        self._reserved: dict[str, Any] = {}
        """Standbys reserved by ``standby_for``, waiting for their ``launch``."""
        self._standby_template: dict[str, Any] | None = None
        self._standby_groups: dict[str, list[Any]] = {}
        """Each standby's placement groups as last seen (``touch``)."""
        self._next_orphan_scan = 0.0

    def connect(self) -> None:
        """``settings.ray_address`` if set, else a local Ray; an already initialised Ray is used as it is."""
        import ray

        if ray.is_initialized():
            self._retire_orphaned_standbys()
            return
        os.environ.setdefault("RAY_TRAIN_V2_ENABLED", "1")
        if self.settings.ray_address:
            ray.init(address=self.settings.ray_address, namespace=NAMESPACE, log_to_driver=False)
        else:
            # address="local": a Ray of our own, never one a stray `ray start` left on this host (plain ray.init()
            # attaches to that, and then refuses num_cpus)
            # the preloaded modules make Ray's prestarted workers warm: see Settings.ray_preload_modules
            system: dict[str, Any] = {}
            if self.settings.ray_preload_modules:
                system["preload_python_modules"] = list(self.settings.ray_preload_modules)
            ray.init(address="local", num_cpus=self.settings.ray_num_cpus, namespace=NAMESPACE,
                     include_dashboard=False, log_to_driver=False, _system_config=system)
            self._owns_ray = True
        self._retire_orphaned_standbys()

    def shutdown(self) -> None:
        import ray

        for name in list(self._standbys) + list(self._reserved):
            self._retire(name)
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def free_cpus(self) -> float | None:
        import ray

        resources: dict[str, float] = ray.available_resources()  # type: ignore[no-untyped-call]
        return float(resources.get("CPU", 0.0)) + self._standby_cpus()

    def capacity(self) -> dict[str, float] | None:
        """The whole cluster's CPUs and GPUs (busy or not): what a run can ever get, short of an autoscaler."""
        import ray

        total: dict[str, float] = ray.cluster_resources()  # type: ignore[no-untyped-call]
        return {"CPU": float(total.get("CPU", 0.0)), "GPU": float(total.get("GPU", 0.0))}

    def launch(self, *, name: str, run_id: int, attempt: int, launch: dict[str, Any]) -> Any:
        """Start the worker group; a local checkpoint root the cluster's nodes do not share is refused first (the
        cluster may have grown since the run was submitted, so this is checked at every launch)."""
        import ray

        refusal = self.settings.checkpoint_root_refusal(alive_nodes())
        if refusal is not None:
            raise UnsharedCheckpointRoot(refusal)
        reserved = self._reserved.pop(name, None)
        if reserved is not None:
            self._standby_groups.pop(name, None)  # the run's now: its channel frees them when it is killed
            try:
                ray.get(reserved.adopt.remote(run_id, attempt, launch), timeout=60)
            except Exception:
                self.kill(reserved)  # whether or not it took the launch, nobody else may: the attempt fails to start
                raise
            return reserved
        self._make_room(float(launch["num_workers"]) * float(launch["cpus_per_worker"]))
        cls = channel_actor_class()
        # the recipe's ``code`` (Ray's runtime_env) is the actor's: its preflight task, the Train controller and
        # the workers inherit it
        options: dict[str, Any] = {"name": name, "namespace": NAMESPACE, "lifetime": "detached",
                                   "get_if_exists": True}
        if launch.get("runtime_env"):
            options["runtime_env"] = upload_local_code(launch["runtime_env"])
        handle = cls.options(**options).remote(run_id, attempt)
        status = ray.get(handle.fit_status.remote(), timeout=60)
        if status.get("state") == "idle":  # get_if_exists found nothing running: this call starts it
            ray.get(handle.start.remote(launch), timeout=60)
        return handle

    # ------------------------------------------------------------------------------- standby groups
    def standby_for(self, launch: Mapping[str, Any]) -> str | None:
        import ray

        self._unreserve()
        if self._standby_template is None or not fits_standby(launch, self._standby_template):
            return None
        for name, handle in list(self._standbys.items()):
            try:
                state = ray.get(handle.standby_state.remote(), timeout=5)
            except ray.exceptions.RayError:
                self._retire(name)  # gone: freed, and the next keep_standby replaces it
                continue
            if state["ready"] and not state["adopted"]:
                self._reserved[name] = self._standbys.pop(name)
                return name
        return None

    def keep_standby(self, template: Mapping[str, Any], free_cpus: float | None) -> None:
        """Start one standby per call while fewer than ``standby_worker_groups`` wait and the CPUs it holds are
        spare: ``free_cpus`` (the scheduler's count, launches not yet placed deducted) less the standbys' own."""
        self._unreserve()
        self._prune_standbys()
        if time.monotonic() >= self._next_orphan_scan:
            self._retire_orphaned_standbys()
        wanted = self.settings.standby_worker_groups
        self._standby_template = dict(template)
        if len(self._standbys) >= wanted:
            return
        cpus = float(template["cpus_per_worker"])
        if free_cpus is None or free_cpus - self._standby_cpus() < cpus - 1e-9:
            return
        import uuid

        name = f"{STANDBY_PREFIX}{uuid.uuid4().hex[:12]}"
        cls = channel_actor_class()
        handle = cls.options(name=name, namespace=NAMESPACE, lifetime="detached").remote(0, 0, self.owner)
        handle.start_standby.remote({**template, "run_name": name})
        self._standbys[name] = handle

    def _prune_standbys(self) -> None:
        """Drop the standbys that can no longer take a run (the actor died, the worker group's start failed), so
        ``keep_standby`` replaces them; a failed start is logged with Ray's error."""
        import ray

        for name, handle in list(self._standbys.items()):
            try:
                touched: dict[str, Any] = ray.get(handle.touch.remote(), timeout=5)
            except ray.exceptions.GetTimeoutError:
                continue  # busy: ask again next tick
            except ray.exceptions.RayError as exc:
                touched = {"fit": {"state": "lost", "error": one_line(exc)}}
            if touched.get("placement_groups"):
                self._standby_groups[name] = list(touched["placement_groups"])
            fit = touched["fit"]
            if fit.get("state") in ("running", "idle"):
                continue
            log.warning("standby worker group %s ended before a run took it (%s): %s", name, fit.get("state"),
                        one_line(str(fit.get("error") or "")))
            self._retire(name)

    def _unreserve(self) -> None:
        """A reservation lasts from ``standby_for`` to the ``launch`` of the same claim: one left over (the claim's
        transaction failed before the launch) returns to the pool."""
        self._standbys.update(self._reserved)
        self._reserved.clear()

    def _standby_cpus(self) -> float:
        if self._standby_template is None:
            return 0.0
        return float(self._standby_template["cpus_per_worker"]) * len(self._standbys)

    def _make_room(self, cpus: float) -> None:
        """Retire idle standbys until Ray has ``cpus`` available, or none is left (their CPUs counted as free)."""
        import ray

        while self._standbys:
            available = float(ray.available_resources().get("CPU", 0.0))  # type: ignore[no-untyped-call]
            if available >= cpus - 1e-9:
                return
            self._retire(next(iter(self._standbys)))

    def _retire(self, name: str) -> None:
        """Kill an idle standby and free its placement group. Its Train controller creates the group some seconds
        before the worker registers it with the channel, and Ray keeps a group whose creator was killed for the
        life of the job: so a standby still starting is given ``RETIRE_WAIT_S`` to register it first, and the
        groups last seen by ``touch`` are freed too, for a channel that died with them."""
        import ray
        from ray.util import remove_placement_group

        handle = self._standbys.pop(name, None) or self._reserved.pop(name, None)
        groups = self._standby_groups.pop(name, [])
        if handle is None:
            return
        deadline = time.monotonic() + self.RETIRE_WAIT_S
        while not groups and time.monotonic() < deadline:
            try:
                touched = ray.get(handle.touch.remote(), timeout=5)
            except ray.exceptions.RayError:
                break  # gone: nothing more to learn from it
            groups = list(touched["placement_groups"])
            if groups or touched["fit"].get("state") not in ("running", "idle"):
                break  # registered (the worker does so before it is ready), or the start failed
            time.sleep(0.2)
        self.kill(handle)
        for pg in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)

    def _retire_orphaned_standbys(self) -> None:
        """Kill the idle standbys whose scheduler is gone: one on this host whose process has exited, or any that
        no scheduler has touched for ``ORPHAN_S`` (its scheduler ran elsewhere: a pod that was replaced). An adopted
        one is a run's channel and is left alone. Runs at connect, then every ``ORPHAN_SCAN_S`` while standbys are
        kept."""
        import ray
        from ray.util import list_named_actors

        from orchestrator.scheduler.claims import owner_is_dead_here

        self._next_orphan_scan = time.monotonic() + self.ORPHAN_SCAN_S
        for entry in list_named_actors(all_namespaces=True):
            name = str(entry.get("name", ""))
            if entry.get("namespace") != NAMESPACE or not name.startswith(STANDBY_PREFIX):
                continue
            if name in self._standbys or name in self._reserved:
                continue
            handle = self.attach(name)
            if handle is None:
                continue
            with contextlib.suppress(ray.exceptions.RayError):
                state = ray.get(handle.standby_state.remote(), timeout=15)
                owner = state["owner"]
                if state["adopted"] or owner == self.owner:
                    continue
                if owner_is_dead_here(owner) or state["untouched_s"] > self.ORPHAN_S:
                    log.info("retiring standby worker group %s, left by scheduler %s", name, owner)
                    self.kill(handle)

    def attach(self, name: str) -> Any | None:
        import ray

        try:
            handle = ray.get_actor(name, namespace=NAMESPACE)
            ray.get(handle.ping.remote(), timeout=15)
        except (ValueError, ray.exceptions.RayError):
            return None
        return handle

    def poll(self, handle: Any, acked: Mapping[int, int]) -> dict[str, Any] | None:
        import ray

        try:
            result: dict[str, Any] = ray.get(handle.poll.remote(dict(acked)), timeout=30)
        except ray.exceptions.GetTimeoutError:
            return None  # busy or slow: try again next tick
        except ray.exceptions.RayError as exc:
            raise ChannelLost(f"{type(exc).__name__}: {one_line(exc)}") from None
        return result

    def request_stop(self, handle: Any) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(handle.request_stop.remote(), timeout=15)

    def answer_plan(self, handle: Any, attempt: int, plan: dict[str, Any] | None) -> None:
        import ray

        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(handle.answer_plan.remote(attempt, plan), timeout=15)

    def kill(self, handle: Any) -> None:
        """End the worker group now: the actor, its Train controller and workers, and their placement group."""
        import ray
        from ray.util import remove_placement_group

        groups: list[Any] = []
        with contextlib.suppress(ray.exceptions.RayError):
            groups = ray.get(handle.placement_groups.remote(), timeout=10)
        with contextlib.suppress(ray.exceptions.RayError, ValueError):
            ray.kill(handle, no_restart=True)
        for pg in groups:
            with contextlib.suppress(Exception):
                remove_placement_group(pg)


def upload_local_code(runtime_env: Mapping[str, Any]) -> dict[str, Any]:
    """``runtime_env`` with its local ``py_modules`` / ``working_dir`` uploaded to the cluster (GCS) and replaced by
    their ``gcs://`` URIs; URIs are left as they are.

    Ray accepts local paths in a runtime_env only at the job level (``ray.init``), not on an actor, so the
    scheduler uploads them itself, as ``ray.init`` does for a job: with the same functions (internal to Ray, hence
    this one place), content-addressed, so the same package is uploaded once."""
    import tempfile

    import ray
    from ray._private.runtime_env.py_modules import upload_py_modules_if_needed
    from ray._private.runtime_env.working_dir import upload_working_dir_if_needed

    node: Any = ray._private.worker.global_worker.node
    scratch = str(node.get_runtime_env_dir_path()) if node is not None else tempfile.gettempdir()
    env = dict(runtime_env)
    env = upload_py_modules_if_needed(env, include_gitignore=True, scratch_dir=scratch)
    env = upload_working_dir_if_needed(env, include_gitignore=True, scratch_dir=scratch)
    return dict(env)
