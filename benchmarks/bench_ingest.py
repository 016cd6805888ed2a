"""Event ingest at scale: many concurrent attempts → the real channel actors → the real scheduler → PostgreSQL.

What runs, all of it the production code except the pushers and the training they stand for:

* ``--attempts`` runs (default 100), each a real ``runs`` row with one running ``attempts`` row, claimed by one
  scheduler, each with its own ``RunChannel`` actor (``orchestrator.channel``, on a local ``ray.init(num_cpus=2)``),
  as ``RayLauncher.launch`` would create it (the fit is never started: no training, just the channel);
* ``--pushers`` Ray actors stand in for the attempts' rank-0 workers: each holds the real ``workers.ray_sink.ActorSink``
  of its share of attempts and emits per-step ``metric`` events at ``--rate`` events/s in total (an ``anomaly``
  every 500 steps, a ``checkpoint`` every 1000), so batching, ``seq`` numbering and the ``ts`` stamp are the
  workers' own;
* the real ``Scheduler`` loop (``Scheduler.start()``: renew leases → ``service`` each run: read the acked cursors,
  ``poll`` the channel, ingest and commit in one transaction → adoption and claims), every
  ``scheduler_poll_seconds``, in this process.

Figures per variant, over a ``--seconds`` window after a warm-up:

* **events/s**: events committed to the store in the window ÷ its length (the offered rate is ``--rate``; a
  variant that cannot keep up shows a lower rate and a growing lag);
* **lag**: the worker's ``ts`` stamp → the commit of the transaction that stored the event (an ``after_commit``
  hook on the scheduler's session factory), p50/p99/max over every event committed in the window;
* **CPU per 1k events**, in ms: the scheduler process (this one: the loop, its Ray client threads), the channel
  actors, and the PostgreSQL backends serving the benchmark database (from ``/proc``), each ÷ events.

Variants, in one run, on the same database, channels and pushers' code, interleaved when ``--repeats`` > 1:

* ``before``: the scheduler's service as it was at ``--before-commit`` (``orchestrator/scheduler/service.py``
  loaded from git into a module of its own; the tick calls its ``service`` once per run, as that commit's loop
  did: two transactions and ~9 statements per run), with the sink at that commit's defaults (0.2 s / 64 events);
* ``after``: the tree's code (``service_all``: one transaction per tick, ``ingest_many``) with the tree's
  ``ActorSink`` defaults;
* ``batched-sink0.2``: the tree's service with the old sink defaults (the scheduler's change alone);
* ``ingest-63f183b``: ``ingest_events`` as it was at 63f183b (before the ``unnest`` insert) in the ``before``
  service, with the old sink defaults.

``--sink-flush-interval`` / ``--sink-max-batch`` override every variant's sink settings.

Between variants the event tables are emptied and the attempts' cursors reset; the channels are drained empty.

Besides, per variant: the scheduler's wall time in services, channel polls, the ingest function and all SQL
statements (per 1k events), statements per service, the backlog left at the window's end and the rate at which the
scheduler clears it once the pushers have stopped (the control plane's own ceiling); and, once, the CPU the idle
channel actors cost.

Usage: ``python benchmarks/bench_ingest.py [--attempts 100] [--rate 20000] [--seconds 20] [--warmup 5]
[--pushers 2] [--poll 0.5] [--sink-flush-interval S] [--sink-max-batch N] [--drain-timeout 60]
[--variants before,after] [--repeats 1] [--json]``. Needs the PostgreSQL server of the tests
(``BALLAST_TEST_PG_URL``, default ``postgres@127.0.0.1:5432``, trust auth); the database is created and dropped.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import types
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import sqlalchemy as sa  # noqa: E402
from pg import pg_database  # noqa: E402  (benchmarks/pg.py)

BEFORE_COMMIT = "5044150"
"""The last commit before the tick's shared transaction (its ``orchestrator/scheduler/service.py`` is the
``before`` variant)."""
INGEST_BEFORE_COMMIT = "63f183b"
"""The last commit before the ``unnest`` insert (its ``orchestrator/store/ingest.py``: ``ingest-63f183b``)."""
OLD_SINK = {"flush_interval": 0.2, "max_batch": 64}
"""``ActorSink``'s defaults at ``BEFORE_COMMIT``."""
RECIPE: dict[str, Any] = {"name": "ingest-bench", "checkpoint": {"keep": 3}}
SCHEDULER_ID = "bench-ingest"


# --------------------------------------------------------------------------------------------- the database


def make_runs(factory: Any, n: int) -> list[int]:
    """``n`` running runs, each with a running attempt 1, claimed by the benchmark's scheduler."""
    from contracts.recipe import validate_recipe_data
    from orchestrator.store.db import transaction
    from orchestrator.store.models import Attempt, utcnow
    from orchestrator.store.repo import create_run

    recipe = validate_recipe_data(RECIPE)
    ids = []
    with transaction(factory) as s:
        for i in range(n):
            run, _ = create_run(session=s, owner="bench", recipe=recipe, text=json.dumps(RECIPE),
                                idempotency_key=f"bench-{i}")
            run.state = "running"
            run.current_attempt = 1
            run.claimed_by = SCHEDULER_ID
            run.started_at = utcnow()
            s.add(Attempt(run_id=run.id, number=1, state="running", kind="initial", started_at=utcnow()))
            s.flush()
            ids.append(run.id)
    return ids


def reset(factory: Any) -> None:
    """Empty the event tables and rewind the attempts' cursors (between variants)."""
    from orchestrator.store.db import transaction

    with transaction(factory) as s:
        for table in ("metric_points", "anomalies", "eval_points", "checkpoints"):
            s.execute(sa.text(f"DELETE FROM {table}"))
        s.execute(sa.text("UPDATE attempts SET last_seq = 0, last_step = NULL"))
        s.execute(sa.text("UPDATE runs SET best_loss = NULL, last_step = NULL"))


def table_counts(factory: Any) -> dict[str, int]:
    from orchestrator.store.db import transaction

    with transaction(factory) as s:
        return {t: int(s.scalar(sa.text(f"SELECT count(*) FROM {t}")) or 0)
                for t in ("metric_points", "anomalies", "checkpoints")}


# --------------------------------------------------------------------------------------------------- CPU
def cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU time of these processes from /proc (None when one of them is gone)."""
    total = 0.0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def backend_pids(url: str) -> list[int]:
    engine = sa.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()"
            ))
            return [int(r[0]) for r in rows]
    finally:
        engine.dispose()


# ----------------------------------------------------------------------------------------------- pushers
class Pusher:
    """Stands in for the rank-0 workers of some attempts: the real ``ActorSink`` per attempt, paced emits."""

    def __init__(self, handles: list[Any], rate_per_attempt: float, sink_options: dict[str, Any]) -> None:
        from workers.ray_sink import ActorSink

        self.sinks = [ActorSink(h, attempt=1, **sink_options) for h in handles]
        self.rate = rate_per_attempt
        self.stop_flag = False
        self.emitted = 0

    def run(self, seconds: float) -> int:
        """Emit for ``seconds`` at the pace (catching up after a stall), then flush; returns events emitted."""
        start = time.monotonic()
        steps = [0] * len(self.sinks)
        while not self.stop_flag:
            now = time.monotonic()
            if now - start >= seconds:
                break
            due = int((now - start) * self.rate)
            for i, sink in enumerate(self.sinks):
                while steps[i] < due:
                    step = steps[i]
                    sink.emit("metric", {"step": step, "loss": 2.0 + 1.0 / (1 + step), "grad_norm": 1.0,
                                         "grad_norm_clipped": 1.0, "lr": 1e-3, "loss_scale": None,
                                         "throughput": 1000.0, "skipped": False})
                    if step % 500 == 250:
                        sink.emit("anomaly", {"step": step, "rank": 0, "kind": "grad_norm_spike",
                                              "detector": "grad_norm_spike", "value": 9.0, "threshold": 5.0,
                                              "action": "record", "details": {"z": 7.5}})
                    if step % 1000 == 999:
                        sink.emit("checkpoint", {"step": step, "uri": f"/nonexistent/ckpt/step_{step:08d}",
                                                 "sha256": "a" * 64, "healthy": True,
                                                 "verdict": {"weights_finite": True}, "metrics": {"loss": 2.0}})
                    steps[i] += 1
                # ActorSink flushes on its own clock only when emitting: flush due buffers like a step would
                if sink._buffer and time.monotonic() - sink._last_flush >= sink.flush_interval:
                    sink.flush()
            time.sleep(0.01)
        for sink in self.sinks:
            sink._flush_and_wait(30.0)
        return sum(s._seq for s in self.sinks)

    def pid(self) -> int:
        return os.getpid()


# ------------------------------------------------------------------------------------------ lag recording
class LagRecorder:
    """Wraps the ingest function the scheduler calls: remembers each event's ``ts`` in the session and, at the
    commit of that session's transaction, records ``commit time - ts`` per event."""

    def __init__(self, factory: Any) -> None:
        from sqlalchemy import event

        self.lock = threading.Lock()
        self.window: tuple[float, float] | None = None
        self.lags: list[float] = []
        self.committed = 0
        self.committed_metrics = 0
        self.ingest_s = 0.0
        self.ingest_calls = 0
        self.factory = factory
        event.listen(factory, "after_commit", self._after_commit)
        event.listen(factory, "after_rollback", self._after_rollback)

    def close(self) -> None:
        from sqlalchemy import event

        event.remove(self.factory, "after_commit", self._after_commit)
        event.remove(self.factory, "after_rollback", self._after_rollback)

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def ingest_events(*, session: Any, events: Any, **kw: Any) -> Any:
            evs = list(events)
            started = time.perf_counter()
            result = fn(session=session, events=evs, **kw)
            took = time.perf_counter() - started
            pending = session.info.setdefault("bench_ts", [])
            pending.extend((float(e.get("ts") or 0.0), e.get("type") == "metric") for e in evs)
            with self.lock:
                self.ingest_s += took
                self.ingest_calls += 1
            return result

        return ingest_events

    def wrap_many(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def ingest_many(*, session: Any, batches: Any, **kw: Any) -> Any:
            batches = [(run, attempt, list(events)) for run, attempt, events in batches]
            started = time.perf_counter()
            result = fn(session=session, batches=batches, **kw)
            took = time.perf_counter() - started
            pending = session.info.setdefault("bench_ts", [])
            pending.extend((float(e.get("ts") or 0.0), e.get("type") == "metric")
                           for _, _, evs in batches for e in evs)
            with self.lock:
                self.ingest_s += took
                self.ingest_calls += 1
            return result

        return ingest_many

    def _after_commit(self, session: Any) -> None:
        pending = session.info.pop("bench_ts", None)
        if not pending:
            return
        now = time.time()
        with self.lock:
            if self.window is not None and self.window[0] <= now < self.window[1]:
                self.committed += len(pending)
                self.committed_metrics += sum(1 for _, m in pending if m)
                self.lags.extend(now - ts for ts, _ in pending)

    def _after_rollback(self, session: Any) -> None:
        session.info.pop("bench_ts", None)


def load_before(commit: str, path_in_repo: str = "orchestrator/store/ingest.py",
                name: str = "ingest_before") -> types.ModuleType:
    """A module of the tree as it was at ``commit``, as a module of its own (``name``)."""
    text = subprocess.run(["git", "-C", str(REPO), "show", f"{commit}:{path_in_repo}"],
                          check=True, capture_output=True, text=True).stdout
    path = Path(tempfile.mkdtemp(prefix="bench-ingest-")) / f"{name}.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------------------ one pass
def percentile(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Variant:
    """What a variant puts in the scheduler's place: the service module the tick calls (``service_all`` of the
    tree, or an old module's per-run ``service``), the ingest function in it, and the sink's settings."""

    def __init__(self, service_module: types.ModuleType, *, per_run: bool, sink: Mapping[str, Any],
                 ingest: Callable[..., Any] | None = None) -> None:
        self.module, self.per_run, self.sink, self.ingest = service_module, per_run, dict(sink), ingest


def variants(args: argparse.Namespace) -> dict[str, Variant]:
    import orchestrator.scheduler.service as tree_service
    from workers.ray_sink import ActorSink

    sink = {"flush_interval": ActorSink.DEFAULT_FLUSH_INTERVAL, "max_batch": ActorSink.DEFAULT_MAX_BATCH}
    out = {"after": Variant(tree_service, per_run=False, sink=sink),
           "batched-sink0.2": Variant(tree_service, per_run=False, sink=OLD_SINK)}
    names = set(args.variants.split(","))
    if "before" in names or "ingest-63f183b" in names:
        old = load_before(args.before_commit, "orchestrator/scheduler/service.py", "service_before")
        out["before"] = Variant(old, per_run=True, sink=OLD_SINK)
        if "ingest-63f183b" in names:
            out["ingest-63f183b"] = Variant(old, per_run=True, sink=OLD_SINK,
                                            ingest=load_before(INGEST_BEFORE_COMMIT).ingest_events)
    for v in out.values():
        if args.sink_flush_interval is not None:
            v.sink["flush_interval"] = args.sink_flush_interval
        if args.sink_max_batch is not None:
            v.sink["max_batch"] = args.sink_max_batch
    return out


def _per_run(service_module: types.ModuleType) -> Callable[[Any, Any], None]:
    """The tick's servicing as at ``BEFORE_COMMIT``: the module's ``service`` once per run."""
    from orchestrator.scheduler.outage import is_outage

    def per_run(ctx: Any, executions: Any) -> None:
        for ex in executions:
            try:
                service_module.service(ctx, ex)
            except Exception as exc:  # noqa: BLE001 - as that loop did: one run's failure is its own
                if is_outage(exc):
                    raise

    return per_run


def one_variant(name: str, variant: Variant, *, url: str, factory: Any, handles: list[Any],
                channel_pids: list[int], args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    import ray

    import orchestrator.scheduler.loop as loop_module
    from orchestrator.scheduler import Scheduler
    from orchestrator.scheduler.context import Execution
    from orchestrator.scheduler.launcher import RayLauncher
    from orchestrator.settings import Settings

    for _, h in handles:  # empty channels (the previous variant's leftovers dropped)
        ray.get(h.drain.remote({1: 2**62}))
    reset(factory)
    settings = Settings(home=tmp, database_url=url, checkpoint_root="/nonexistent/ckpt",
                        scheduler_poll_seconds=args.poll, max_concurrent_runs=len(handles))
    scheduler = Scheduler(settings, factory, SCHEDULER_ID, launcher=RayLauncher(settings))
    for run_id, handle in handles:
        scheduler.ctx.executions[run_id] = Execution(run_id=run_id, name=f"bench-{run_id}", handle=handle,
                                                     attempt=1, demand_cpus=0.0, started=True)
    recorder = LagRecorder(factory)
    service_module = variant.module
    ingest_name = "ingest_events" if variant.per_run else "ingest_many"
    original = getattr(service_module, ingest_name)
    setattr(service_module, ingest_name, recorder.wrap(variant.ingest or original) if variant.per_run
            else recorder.wrap_many(original))
    timers = {"poll": 0.0, "service": 0.0}  # wall time of the scheduler's channel polls and of whole services
    launcher = scheduler.ctx.launcher
    real_poll = launcher.poll

    def timed_poll(handle: Any, acked: Mapping[int, int]) -> dict[str, Any] | None:
        started = time.perf_counter()
        try:
            return real_poll(handle, acked)
        finally:
            timers["poll"] += time.perf_counter() - started

    launcher.poll = timed_poll  # type: ignore[method-assign]
    db = {"statements": 0, "wall": 0.0, "services": 0}
    started_at: dict[int, float] = {}

    def before_exec(conn: Any, *_: Any) -> None:
        started_at[id(conn)] = time.perf_counter()

    def after_exec(conn: Any, *_: Any) -> None:
        t = started_at.pop(id(conn), None)
        if t is not None:
            db["statements"] += 1
            db["wall"] += time.perf_counter() - t

    from sqlalchemy import event as sa_event

    sa_event.listen(factory.kw["bind"], "before_cursor_execute", before_exec)
    sa_event.listen(factory.kw["bind"], "after_cursor_execute", after_exec)
    real_service_all = loop_module.service_all
    per_run = _per_run(service_module)

    def timed_service(ctx: Any, executions: Any) -> None:
        started = time.perf_counter()
        try:
            (per_run if variant.per_run else service_module.service_all)(ctx, executions)
        finally:
            timers["service"] += time.perf_counter() - started
            db["services"] += len(executions)

    loop_module.service_all = timed_service
    pusher_cls = ray.remote(num_cpus=0)(Pusher)
    per = [handles[i::args.pushers] for i in range(args.pushers)]
    sink_options = variant.sink
    pushers = [pusher_cls.remote([h for _, h in group], args.rate / len(handles), sink_options) for group in per]
    pusher_pids = ray.get([p.pid.remote() for p in pushers])
    scheduler.start()
    try:
        total = args.warmup + args.seconds
        runs = [p.run.remote(total) for p in pushers]
        time.sleep(args.warmup)
        pg = backend_pids(url)
        me = [os.getpid()]
        t0 = time.time()
        cpu0 = {"scheduler": cpu_seconds(me), "channels": cpu_seconds(channel_pids), "postgresql": cpu_seconds(pg),
                "pushers": cpu_seconds(pusher_pids)}
        with recorder.lock:
            recorder.window = (t0, t0 + args.seconds)
            ingest0 = recorder.ingest_s
            poll0, service0 = timers["poll"], timers["service"]
            db0 = dict(db)
        time.sleep(args.seconds)
        cpu1 = {"scheduler": cpu_seconds(me), "channels": cpu_seconds(channel_pids), "postgresql": cpu_seconds(pg),
                "pushers": cpu_seconds(pusher_pids)}
        load = os.getloadavg()[0]
        with recorder.lock:
            ingest_s = recorder.ingest_s - ingest0
            poll_s, service_s = timers["poll"] - poll0, timers["service"] - service0
            db1 = dict(db)
        emitted = sum(ray.get(runs))
        # the backlog at the end of the window, then how fast the scheduler clears it with the pushers stopped
        backlog = emitted - _acked(factory)
        caught0 = time.monotonic()
        deadline = caught0 + args.drain_timeout
        while time.monotonic() < deadline and _acked(factory) < emitted:
            time.sleep(0.25)
        catch_up_s = time.monotonic() - caught0
        left = max(0, emitted - _acked(factory))
        cleared = backlog - left
    finally:
        scheduler.stop()
        # what the scheduler did not take in time is dropped from the channels (acked far beyond any seq), so the
        # next variant starts from empty channels
        ray.get([h.drain.remote({1: 2**62}) for _, h in handles])
        setattr(service_module, ingest_name, original)
        loop_module.service_all = real_service_all
        sa_event.remove(factory.kw["bind"], "before_cursor_execute", before_exec)
        sa_event.remove(factory.kw["bind"], "after_cursor_execute", after_exec)
        recorder.close()
        for p in pushers:
            ray.kill(p)
    counts = table_counts(factory)
    events = recorder.committed
    cpu = {k: (None if cpu0[k] is None or cpu1[k] is None else 1e6 * (cpu1[k] - cpu0[k]) / max(events, 1))
           for k in cpu0}
    return {
        "variant": name,
        "sink": variant.sink,
        "offered_rate": args.rate,
        "events_per_s": events / args.seconds,
        "metric_events_per_s": recorder.committed_metrics / args.seconds,
        "lag_p50_s": percentile(recorder.lags, 0.50),
        "lag_p99_s": percentile(recorder.lags, 0.99),
        "lag_max_s": max(recorder.lags) if recorder.lags else float("nan"),
        "cpu_ms_per_1k": cpu,
        "ingest_fn_ms_per_1k": 1e6 * ingest_s / max(events, 1),
        "emitted": emitted,
        "backlog_at_window_end": backlog,
        "not_ingested_by_the_drain_timeout": left,
        "catch_up_events_per_s": cleared / catch_up_s if catch_up_s > 0 else float("nan"),
        "poll_wall_ms_per_1k": 1e6 * poll_s / max(events, 1),
        "service_wall_ms_per_1k": 1e6 * service_s / max(events, 1),
        "db_wall_ms_per_1k": 1e6 * (db1["wall"] - db0["wall"]) / max(events, 1),
        "statements_per_service": (db1["statements"] - db0["statements"]) / max(1, db1["services"] - db0["services"]),
        "services_per_s": (db1["services"] - db0["services"]) / args.seconds,
        "rows": counts,
        "load1": load,
    }


def _acked(factory: Any) -> int:
    """Events committed so far, all attempts together (the attempts' ``last_seq`` cursors)."""
    from orchestrator.store.db import transaction

    with transaction(factory) as s:
        return int(s.scalar(sa.text("SELECT coalesce(sum(last_seq), 0) FROM attempts")) or 0)


def channel_pids_of(handles: list[Any]) -> list[int]:
    """The channel actors' processes: the workers of this Ray session named ``ray::RunChannel``."""
    import psutil
    import ray

    node = ray._private.worker._global_node
    raylet = node.all_processes["raylet"][0].process.pid
    return [c.pid for c in psutil.Process(raylet).children(recursive=True)
            if any("RunChannel" in part for part in c.cmdline()[:1])]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--attempts", type=int, default=100)
    ap.add_argument("--rate", type=float, default=20_000.0, help="offered events/s, all attempts together")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--pushers", type=int, default=2)
    ap.add_argument("--sink-flush-interval", type=float, default=None,
                    help="ActorSink's, for every variant (default: each variant's own)")
    ap.add_argument("--sink-max-batch", type=int, default=None,
                    help="ActorSink's, for every variant (default: each variant's own)")
    ap.add_argument("--poll", type=float, default=0.5, help="scheduler_poll_seconds (the default setting)")
    ap.add_argument("--drain-timeout", type=float, default=60.0,
                    help="after the window, wait at most this long for the backlog to clear")
    ap.add_argument("--variants", default="before,after")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--before-commit", default=BEFORE_COMMIT)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import ray

    import migrations
    from orchestrator.channel import NAMESPACE, channel_actor_class
    from orchestrator.store.db import make_engine, make_session_factory

    by_name = variants(args)
    order = [v for v in args.variants.split(",") if v] * args.repeats
    results = []
    with pg_database("ballast_bench_ingest") as url, tempfile.TemporaryDirectory() as tmpdir:
        migrations.upgrade(url)
        engine = make_engine(url)
        factory = make_session_factory(engine)
        run_ids = make_runs(factory, args.attempts)
        ray.init(address="local", num_cpus=2, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
        try:
            cls = channel_actor_class()
            handles = [(rid, cls.options(name=f"bench-ingest-{uuid.uuid4().hex[:8]}-{rid}").remote(rid, 1))
                       for rid in run_ids]
            ray.get([h.ping.remote() for _, h in handles], timeout=600)
            cpids = channel_pids_of([h for _, h in handles])
            idle0, t_idle = cpu_seconds(cpids), time.monotonic()
            time.sleep(5.0)
            idle1 = cpu_seconds(cpids)
            if idle0 is not None and idle1 is not None and not args.json:
                print(f"{len(cpids)} idle channel actors: {1000 * (idle1 - idle0) / (time.monotonic() - t_idle):.0f} "
                      "ms CPU per second together", flush=True)
            for name in order:
                r = one_variant(name, by_name[name], url=url, factory=factory, handles=handles,
                                channel_pids=cpids, args=args, tmp=Path(tmpdir))
                results.append(r)
                if not args.json:
                    print(_line(r), flush=True)
        finally:
            ray.shutdown()
            engine.dispose()
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(_summary(results))


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1f}"


def _line(r: Mapping[str, Any]) -> str:
    c = r["cpu_ms_per_1k"]
    return (f"{r['variant']:>6} (sink {r['sink']['flush_interval']:g} s / {r['sink']['max_batch']}): "
            f"{r['events_per_s']:,.0f} events/s committed (offered {r['offered_rate']:,.0f}); "
            f"lag p50 {r['lag_p50_s']:.2f} s, p99 {r['lag_p99_s']:.2f} s, max {r['lag_max_s']:.2f} s; "
            f"CPU ms/1k events: scheduler {_fmt(c['scheduler'])}, "
            f"channels {_fmt(c['channels'])}, PostgreSQL {_fmt(c['postgresql'])}, pushers {_fmt(c['pushers'])}; "
            f"scheduler wall ms/1k: services {r['service_wall_ms_per_1k']:.0f}, of which polls "
            f"{r['poll_wall_ms_per_1k']:.0f}, ingest {r['ingest_fn_ms_per_1k']:.0f}, all SQL statements "
            f"{r['db_wall_ms_per_1k']:.0f} ({r['statements_per_service']:.1f} per service, "
            f"{r['services_per_s']:.1f} services/s); backlog at the window's end "
            f"{r['backlog_at_window_end']:,}, cleared at {r['catch_up_events_per_s']:,.0f} events/s; "
            f"rows {r['rows']}; load {r['load1']:.1f}")


def _summary(results: list[Mapping[str, Any]]) -> str:
    by: dict[str, list[Mapping[str, Any]]] = {}
    for r in results:
        by.setdefault(str(r["variant"]), []).append(r)
    out = []
    for name, rs in by.items():
        eps = statistics.median(r["events_per_s"] for r in rs)
        p99 = statistics.median(r["lag_p99_s"] for r in rs)
        out.append(f"{name}: median {eps:,.0f} events/s, p99 lag {p99:.2f} s over {len(rs)} pass(es)")
    return "\n".join(out)


if __name__ == "__main__":
    main()
