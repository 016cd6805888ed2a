"""The scheduler: claims queued runs, runs their attempts on Ray, streams their events into the store, and
closes the recovery loop (divergence or crash → ``orchestrator.policy.recovery.decide`` → the next attempt).

One loop (``Scheduler.tick``, in ``loop``), run in a background thread by ``ballast serve`` or in the foreground
by ``ballast scheduler``. Each tick:

1. renews the lease of every run this scheduler drives (``claims``);
2. services each run's worker group (``service``): drains its channel actor (``orchestrator.channel``), ingests
   the events (``orchestrator.store.ingest``), retires surplus checkpoints (``retention``), answers in-place
   recovery requests (``handshake``), passes on cancellation, and when the worker group has ended maps its
   outcome onto the attempt and asks the policy what comes next (``outcomes``; crash causes from Ray's
   per-rank failures, ``failures``);
3. adopts active runs whose lease expired (``adoption``): reattaches to their channel actor if their Ray work
   still runs, else records the attempt as crashed and resumes per policy;
4. claims queued runs while it has room (``claims``: ``max_concurrent_runs``, the cluster's free CPUs) and
   launches them (``launching``, through a ``launcher``).

Which state changes each of these causes is not written here but in the rules
(``orchestrator.policy.rules``), applied through ``set_run_state`` / ``set_attempt_state``. The database is
committed before anything is told to the workers (a plan answer, a launch), so a scheduler that dies in between
leaves a state the next one can finish from.

Each worker group runs as a Ray Train ``TorchTrainer`` inside its channel actor, a detached, named actor: the
Ray work does not belong to this process, so a restarted scheduler (with a Ray cluster that outlived it) finds
it again. A local Ray started by this process dies with it; its runs are then resumed from their checkpoints.
"""

from orchestrator.scheduler.claims import default_scheduler_id
from orchestrator.scheduler.context import Context, Execution
from orchestrator.scheduler.failures import Failure, summarize_error
from orchestrator.scheduler.launcher import ChannelLost, Launcher, RayLauncher
from orchestrator.scheduler.loop import Scheduler, main
from orchestrator.scheduler.signals import stop_on_signals
from orchestrator.store.checkpoints import verify_checkpoint

__all__ = [
    "ChannelLost", "Context", "Execution", "Failure", "Launcher", "RayLauncher", "Scheduler",
    "default_scheduler_id", "main", "stop_on_signals", "summarize_error", "verify_checkpoint",
]
