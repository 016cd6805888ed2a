"""How the scheduler reaches the compute: the ``Launcher`` protocol, and ``RayLauncher``, which runs each worker
group as a ``RunChannel`` actor (``orchestrator.channel``: detached, named in the ``ballast`` namespace) on Ray.
The fast scheduler tests put a scripted launcher in its place."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from typing import Any, Protocol

from contracts.wire import one_line
from orchestrator.channel import NAMESPACE, channel_actor_class
from orchestrator.settings import Settings


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


class RayLauncher:
    """Worker groups as ``RunChannel`` actors (detached, named in the ``ballast`` namespace) on Ray."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._owns_ray = False

    def connect(self) -> None:
        """``settings.ray_address`` if set, else a local Ray; an already initialised Ray is used as it is."""
        import ray

        if ray.is_initialized():
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

    def shutdown(self) -> None:
        import ray

        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
            self._owns_ray = False

    def free_cpus(self) -> float | None:
        import ray

        resources: dict[str, float] = ray.available_resources()  # type: ignore[no-untyped-call]
        return float(resources.get("CPU", 0.0))

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
