"""Checkpoints off the critical path: the host-memory snapshot the loop pays for, and the thread that does the rest.

The training loop's only cost for a checkpoint is ``HostStaging.copy``: a private copy of the state in host memory
(tensors copied off the device, or cloned on the CPU, into buffers reused from one checkpoint to the next;
containers rebuilt, so the loop may go on changing its own). The
``BackgroundWriter`` then serialises, checksums, writes, verifies and registers it on a thread of its own, with at
most one write in flight: a save that finds the previous one still running waits for it, the one stall besides
the copy.

What a caller of ``BackgroundWriter`` gets back (``collect``) is the job's result or its exception, on the
caller's own thread: the ``Checkpointer`` (``workers/checkpointing.py``) registers a checkpoint (the ``checkpoint``
event, the attempt's result) only from there, once its job returned, i.e. once the checkpoint was written and
verified. A job that raises, or a process that dies mid-write, registers nothing, and the previous checkpoint stays
the newest one in force.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

import torch

T = TypeVar("T")


class HostStaging:
    """Host-memory copies of a weights-only state (``workers/checkpoint.py``'s format) that share nothing mutable
    with it: every tensor copied off the device (or cloned on the CPU), views of one tensor (tied weights) kept one
    copy, every dict, list and tuple rebuilt; the leaves (str, numbers, bytes, None, ``torch.Size``/``dtype``/
    ``device``) are immutable.

    The host buffers are kept and reused by the next ``copy`` (pinned memory for CUDA tensors, copied
    asynchronously and synchronised once), as torch's DCP staging does: after the first checkpoint a copy
    touches no fresh pages. So a snapshot is valid until the next ``copy``: the caller must be done with it
    (its write finished) first, which one write in flight guarantees.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(self, obj: Any) -> Any:
        memo: dict[tuple[Any, ...], torch.Tensor] = {}
        used: dict[tuple[Any, ...], torch.Tensor] = {}
        on_device = False

        def stage(t: torch.Tensor, path: tuple[Any, ...]) -> torch.Tensor:
            nonlocal on_device
            if t.numel() == 0:
                return t.to("cpu", copy=True)
            key = (t.device, t.dtype, t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape),
                   t.stride())
            if key in memo:
                return memo[key]
            buf = self._buffers.get(path)
            if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
                buf = torch.empty(t.shape, dtype=t.dtype, device="cpu",
                                  pin_memory=t.device.type == "cuda" and torch.cuda.is_available())
            buf.copy_(t, non_blocking=t.device.type == "cuda")
            on_device = on_device or t.device.type == "cuda"
            memo[key] = used[path] = buf
            return buf

        def walk(x: Any, path: tuple[Any, ...]) -> Any:
            if isinstance(x, torch.Tensor):
                return stage(x.detach(), path)
            if isinstance(x, dict):
                return type(x)((k, walk(v, (*path, k))) for k, v in x.items())
            if isinstance(x, list):
                return [walk(v, (*path, i)) for i, v in enumerate(x)]
            if isinstance(x, tuple):
                return tuple(walk(v, (*path, i)) for i, v in enumerate(x))
            return x

        out = walk(obj, ())
        if on_device:
            torch.cuda.synchronize()
        self._buffers = used  # parts no longer in the state give their memory back
        return out


def to_host(obj: Any) -> Any:
    """A one-off ``HostStaging`` copy (buffers not reused)."""
    return HostStaging().copy(obj)


class BackgroundWriter(Generic[T]):
    """One worker thread running one job at a time; the caller collects each job's outcome on its own thread.

    ``submit`` refuses while a job is uncollected: the caller decides what a finished job means (registration)
    before starting the next, so outcomes are seen in submission order and never twice.
    """

    def __init__(self, name: str = "ballast-checkpoint-writer") -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)
        self._pending: Future[T] | None = None
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        """A job was submitted and not collected yet (it may have finished)."""
        return self._pending is not None

    def done(self) -> bool:
        """The uncollected job has finished (``collect`` will not wait)."""
        return self._pending is not None and self._pending.done()

    def submit(self, job: Callable[[], T]) -> None:
        with self._lock:
            if self._pending is not None:
                raise RuntimeError("a write is still in flight: collect it before submitting the next")
            self._pending = self._executor.submit(job)

    def collect(self) -> T:
        """Wait for the uncollected job and return its result (or raise its exception)."""
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            raise RuntimeError("no write in flight")
        return pending.result()

    def close(self) -> None:
        """Let a running job finish (its outcome uncollected, so unregistered) and end the thread."""
        self._executor.shutdown(wait=True)
