"""The guarded training loop: apply a recipe, watch every step, checkpoint with a health verdict.

Read it top to bottom: ``run_attempt`` / ``train_loop_per_worker`` → ``GuardedTrainer.train()`` →
``train_step()``. Each step:

1. LR from the schedule (set on the param groups directly; re-warmed after a resume when the plan says so);
2. forward/backward over the micro-batches under autocast with the loss scaler (DDP syncs gradients only on the
   last micro-batch: ``no_sync()`` on the others), with the recipe's faults injected where they would strike;
3. unscale, fused per-tensor grad norms, clipping (in place; a skipped update discards the clipped grads anyway);
4. **one all-gather of a small signals tensor** (loss, grad norm, finite flags, stop flag, loss scale, ...): the
   only host sync of an ordinary step. Every rank derives the same ``StepSignals`` from the same gathered rows,
   so every rank's detectors make the same decision at the same step (otherwise the next collective deadlocks);
5. detectors → ``optimizer.step()`` **only** when the gradients are finite on every rank and the decision is
   ``record``; ``skip_step`` and non-finite steps zero the grads; ``rollback`` ends the attempt as diverged;
6. telemetry through the sink (rank 0 only; never blocks), checkpoints every ``checkpoint.every_steps``.

The same code runs in a plain process (tests, ``ballast train``, library use), inside an already initialised
``torch.distributed`` group, and as the per-worker function of a Ray Train ``TorchTrainer``.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import statistics
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from contracts.checkpoint import apply_retention
from contracts.overrides import apply_overrides
from contracts.recipe import (
    Action,
    Compression,
    DType,
    LossScaling,
    OptimizerName,
    Recipe,
)
from contracts.wire import AttemptOutcome, AttemptSpec, SavedCheckpoint, finite_or_none
from workers.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from workers.clipping import (
    Clipper,
    block_grad_norms,
    block_members,
    global_norm,
    grad_norms,
    param_snapshot,
    per_layer_norms,
    update_ratio,
)
from workers.data import DataSource, build_data
from workers.detectors import Decision, DetectorSuite, Finding, StepSignals, diagnose_depth
from workers.faults import FaultInjector
from workers.models import build_model, freeze_first_n_blocks, param_block_index, set_activation_checkpointing
from workers.precision import LossScaler, autocast
from workers.schedule import lr_at
from workers.sinks import EventSink


class EngineConfigError(ValueError):
    """A recipe setting this engine or backend cannot run; the message starts with the field path."""


# ------------------------------------------------------------------------------------ process context
@dataclass(frozen=True)
class WorkerContext:
    """Rank, world size and device of this process, and how checkpoints leave it."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    ray_train: bool = False
    """Report checkpoints through ``ray.train.report`` (and let Ray Train persist them)."""
    checkpoint_uri_prefix: str | None = None

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _plain_context(recipe: Recipe) -> WorkerContext:
    use_cuda = recipe.resources.use_gpu and torch.cuda.is_available()
    if dist.is_available() and dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
        device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
        return WorkerContext(rank=rank, world_size=world, device=device)
    return WorkerContext(device=torch.device("cuda") if use_cuda else torch.device("cpu"))


def _gather_rows(local: Tensor, ctx: WorkerContext) -> list[list[float]]:
    """All ranks' signal vectors, as host floats: the one host sync of a step."""
    if not ctx.distributed:
        return [local.tolist()]
    out = torch.empty(ctx.world_size * local.numel(), dtype=local.dtype, device=local.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local)
    rows: list[list[float]] = out.view(ctx.world_size, -1).tolist()
    return rows


def _broadcast_object(obj: Any, ctx: WorkerContext) -> Any:
    if not ctx.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# ---------------------------------------------------------------------------------- comm hook state
def _powersgd_state_dict(state: Any) -> dict[str, Any]:
    """PowerSGD's internal state as weights-only-loadable parts (its own pickling keeps a numpy RandomState)."""
    name, keys, pos, has_gauss, cached = state.rng.get_state(legacy=True)
    return {
        "iter": int(state.iter),
        "error_dict": {int(k): v.detach().cpu() for k, v in state.error_dict.items()},
        "p_memory_dict": {int(k): v.detach().cpu() for k, v in state.p_memory_dict.items()},
        "q_memory_dict": {int(k): v.detach().cpu() for k, v in state.q_memory_dict.items()},
        "rng": {"name": str(name), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
                "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)},
    }


def _load_powersgd_state(state: Any, saved: Mapping[str, Any], device: torch.device) -> None:
    state.iter = int(saved["iter"])
    state.error_dict = {int(k): v.to(device) for k, v in saved["error_dict"].items()}
    state.p_memory_dict = {int(k): v.to(device) for k, v in saved["p_memory_dict"].items()}
    state.q_memory_dict = {int(k): v.to(device) for k, v in saved["q_memory_dict"].items()}
    rng = saved["rng"]
    state.rng.set_state((rng["name"], rng["keys"].numpy().astype(np.uint32), int(rng["pos"]),
                         int(rng["has_gauss"]), float(rng["cached"])))


# --------------------------------------------------------------------------------------- the trainer
@dataclass
class _StepReport:
    step: int
    signals: StepSignals
    decision: Decision
    applied: bool
    stop: bool


class GuardedTrainer:
    """One attempt on one rank. Build it, then ``train()``; see the module docstring for the step."""

    def __init__(
        self,
        spec: AttemptSpec,
        ctx: WorkerContext,
        sink: EventSink | None = None,
        resume_dir: str | Path | None = None,
    ) -> None:
        self.spec = spec
        self.recipe = r = spec.recipe
        self.ctx = ctx
        self.sink = sink if ctx.is_main else None
        self.device = ctx.device
        self._check_backend()
        if r.training.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)

        self.data: DataSource = build_data(
            r.data, seed=r.training.seed, batch_size=r.training.batch_size, rank=ctx.rank,
            world_size=ctx.world_size, allowed_import_modules=spec.allowed_import_modules,
        )
        model = build_model(r.model, self.data, seed=r.training.seed,
                            allowed_import_modules=spec.allowed_import_modules)
        if r.distributed.freeze_first_n_blocks:
            freeze_first_n_blocks(model, r.distributed.freeze_first_n_blocks)
        if r.distributed.activation_checkpointing:
            set_activation_checkpointing(model, True)
        self.module: nn.Module = model.to(self.device)
        self.named_params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self._block_members = self._block_membership()

        saved: dict[str, Any] | None = None
        self.start_step = 0
        if resume_dir is not None:
            saved, manifest = load_checkpoint(resume_dir)
            self.start_step = manifest.step
            self.module.load_state_dict(saved["model"])
        else:  # a fresh start seeds the global RNG per rank (dropout in custom models); a resume restores it
            torch.manual_seed(r.training.seed * 1009 + ctx.rank)

        self.model: nn.Module = self.module
        self.comm_state: Any = None
        if ctx.distributed:
            self.model = self._wrap_ddp()
        self.optimizer = self._build_optimizer()
        self.scaler = LossScaler(r.precision, self.device)
        self.clipper = Clipper(r.clipping, self.named_params)
        self.fp16_dynamic = r.precision.dtype is DType.fp16 and r.precision.loss_scaling is LossScaling.dynamic
        self.detectors = DetectorSuite(r.detectors, fp16=self.fp16_dynamic)
        self.faults = FaultInjector(r.faults, attempt=spec.attempt, rank=ctx.rank)

        self._pending_update_ratio: Tensor | None = None
        if saved is not None:
            if self.comm_state is not None:
                self._prime_ddp_buckets()
            self._restore(saved)

        self.result = AttemptOutcome(outcome="succeeded", attempt=spec.attempt, start_step=self.start_step,
                                    final_step=self.start_step)
        self._healthy_norms: list[float] = []
        self._findings_since_checkpoint = 0
        self._last_loss = float("nan")
        self._last_time = time.perf_counter()
        self._samples_per_step = r.training.batch_size * r.training.grad_accum_steps * ctx.world_size

    # ------------------------------------------------------------------------------------------ setup
    def _check_backend(self) -> None:
        comp = self.recipe.distributed.compression
        if not self.ctx.distributed or comp is Compression.none:
            return
        backend = dist.get_backend()
        if comp is Compression.bf16 and backend != "nccl":
            raise EngineConfigError(
                f"distributed.compression: bf16 compression needs NCCL (resources.use_gpu: true); this worker "
                f"group uses {backend}. Use fp16 or powersgd compression on CPU."
            )
        if comp is Compression.powersgd and self.recipe.distributed.powersgd_start_iter < 2:
            raise EngineConfigError(
                "distributed.powersgd_start_iter: must be >= 2 (PowerSGD's error feedback needs a vanilla "
                "allreduce step first)"
            )

    def _wrap_ddp(self) -> nn.Module:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(self.module, device_ids=device_ids)
        d = self.recipe.distributed
        if d.compression is Compression.fp16:
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif d.compression is Compression.bf16:
            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        elif d.compression is Compression.powersgd:
            self.comm_state = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=d.powersgd_rank,
                start_powerSGD_iter=d.powersgd_start_iter, random_seed=self.recipe.training.seed,
            )
            ddp.register_comm_hook(self.comm_state, powerSGD_hook.powerSGD_hook)
        return ddp

    def _build_optimizer(self) -> torch.optim.Optimizer:
        o = self.recipe.optimizer
        if o.name is OptimizerName.sgd:
            return torch.optim.SGD(self.params, lr=o.lr, momentum=o.momentum, nesterov=o.nesterov and o.momentum > 0,
                                   weight_decay=o.weight_decay)
        cls = torch.optim.AdamW if o.name is OptimizerName.adamw else torch.optim.Adam
        return cls(self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)

    def _hyperparameters(self) -> dict[str, Any]:
        o = self.recipe.optimizer
        if o.name is OptimizerName.sgd:
            return {"momentum": o.momentum, "nesterov": o.nesterov and o.momentum > 0, "weight_decay": o.weight_decay}
        return {"betas": o.betas, "eps": o.eps, "weight_decay": o.weight_decay}

    def _block_membership(self) -> list[Tensor]:
        """For each block, the indices of its trainable parameters in ``self.params`` (the grad-norm order)."""
        try:
            owner = param_block_index(self.module)
        except ValueError:
            return []
        return block_members([n for n, _ in self.named_params], owner, self.device)

    def _prime_ddp_buckets(self) -> None:
        """One zero-loss forward/backward before PowerSGD's state is restored.

        PowerSGD keys its error-feedback and low-rank memories by DDP bucket, and DDP re-orders the tensors in its
        buckets after the first iteration (the reason PowerSGD needs ``start_powerSGD_iter >= 2``). A resumed
        worker group is at its first iteration again, so it runs this no-op iteration first (grads zero, buffers
        restored, no optimizer step): the saved memories then meet the bucket layout they were saved with.
        """
        buffers = [b.detach().clone() for b in self.module.buffers()]
        accum = self.recipe.training.grad_accum_steps
        inputs, targets = self.data.batch((self.start_step + self.spec.data_offset) * accum)
        with autocast(self.recipe.precision.dtype, self.device):
            loss = self.model((inputs.to(self.device), targets.to(self.device)))
        (loss.float() * 0.0).backward()
        for p in self.params:
            p.grad = None
        with torch.no_grad():
            for b, old in zip(self.module.buffers(), buffers, strict=True):
                b.copy_(old)

    def _restore(self, saved: dict[str, Any]) -> None:
        """Resume: optimizer, scaler, detectors, clipper, comm hook, RNG and the pending update ratio."""
        self.optimizer.load_state_dict(saved["optimizer"])
        for group in self.optimizer.param_groups:  # the (possibly overridden) recipe wins over the checkpoint
            group.update(self._hyperparameters())
        self.scaler.load_state_dict(saved["scaler"])
        self.detectors.load_state_dict(saved["detectors"])
        self.clipper.load_state_dict(saved["clipper"])
        same_world = saved["progress"].get("world_size") == self.ctx.world_size
        comm = saved.get("comm_hook") or []
        if self.comm_state is not None and same_world and comm and comm[self.ctx.rank]:
            _load_powersgd_state(self.comm_state, comm[self.ctx.rank], self.device)
        rngs = saved.get("rng") or []
        if rngs:
            set_rng_state(rngs[self.ctx.rank] if same_world else rngs[0])
        ratio = saved["progress"].get("pending_update_ratio")
        if ratio is not None:
            self._pending_update_ratio = torch.tensor(float(ratio), device=self.device)

    # ------------------------------------------------------------------------------------------ train
    def train(self) -> AttemptOutcome:
        """Run steps until max_steps, a rollback decision, or a stop request; then emit ``end``."""
        r = self.recipe
        max_steps = r.training.max_steps
        every = r.checkpoint.every_steps
        res = self.result
        for step in range(self.start_step, max_steps):
            report = self.train_step(step)
            if report.decision.rollback:
                self._diverged(report)
                break
            res.final_step = step + 1
            if report.stop:
                res.outcome, res.reason = "cancelled", f"stop requested; ended after step {step}"
                break
            if res.final_step % every == 0 or res.final_step == max_steps:
                self.checkpoint(res.final_step)
        else:
            res.reason = f"completed {max_steps} steps"
        res.median_grad_norm = statistics.median(self._healthy_norms) if self._healthy_norms else None
        self._emit("end", res.end_event())
        if self.sink is not None:
            self.sink.flush()
        return res

    def train_step(self, step: int) -> _StepReport:
        r, ctx = self.recipe, self.ctx
        self.faults.before_step(step)
        lr = lr_at(step, base_lr=r.optimizer.lr, max_steps=r.training.max_steps, schedule=r.schedule,
                   rewarm_start=self.start_step if self.spec.rewarm_steps else None,
                   rewarm_steps=self.spec.rewarm_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

        # 1. forward and backward over the micro-batches; DDP all-reduces only on the last one
        accum = r.training.grad_accum_steps
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro in range(accum):
            index = (step + self.spec.data_offset) * accum + micro
            inputs, targets = self.faults.on_batch(step, self.data.batch(index))
            inputs, targets = inputs.to(self.device, non_blocking=True), targets.to(self.device, non_blocking=True)
            last = micro == accum - 1
            with self._no_sync(not last):
                with autocast(r.precision.dtype, self.device):
                    loss = self.model((inputs, targets))
                loss = self.faults.on_loss(step, loss, inputs)
                self.scaler.scale(loss.float() / accum).backward()  # type: ignore[no-untyped-call]
            loss_sum += loss.detach().float()

        # 2. unscale, fused norms, clip (in place; a skipped step throws the grads away below)
        self.scaler.unscale_(self.optimizer)
        self.faults.on_grads(step, self.params)
        norms = grad_norms(self.params)
        pre = global_norm(norms).to(self.device)
        layer_step = self._is_layer_step(step)
        block_norms = block_grad_norms(norms.to(self.device), self._block_members) if layer_step else None
        post = self.clipper.clip(norms)

        # 3. one gather of the step's signals across ranks: the only host sync of an ordinary step
        mean_loss = loss_sum / accum
        stop = self.sink is not None and self.sink.should_stop()
        ratio = self._pending_update_ratio
        self._pending_update_ratio = None
        local = torch.stack([
            mean_loss,
            pre,
            (~torch.isfinite(mean_loss)).float(),
            (~torch.isfinite(pre)).float(),
            torch.tensor(float(stop), device=self.device),
            self.scaler.scale_tensor().to(self.device).float(),
            post.to(self.device).float(),
            ratio if ratio is not None else torch.tensor(float("nan"), device=self.device),
            *([] if block_norms is None else block_norms.unbind(0)),
        ])
        rows = _gather_rows(local, ctx)
        signals = self._signals(step, rows, layer_step)
        post_norm = max(row[6] for row in rows)
        stop_requested = any(row[4] > 0 for row in rows)

        # 4. the decision, then the update only if the numbers and the decision allow it
        decision = self.detectors.observe(signals)
        apply = signals.finite and decision.action is Action.record
        snapshot = param_snapshot(self.params) if apply and self._is_snapshot_step(step) else None
        if apply:
            self.optimizer.step()
        if not decision.rollback:
            self.scaler.update(signals.overflow or not signals.finite)
        self.optimizer.zero_grad(set_to_none=True)
        if snapshot is not None:
            self._pending_update_ratio = update_ratio(snapshot, self.params).to(self.device)

        # 5. telemetry (rank 0 only)
        self._record(step, signals, decision, apply, lr, post_norm, norms if layer_step else None)
        return _StepReport(step=step, signals=signals, decision=decision, applied=apply, stop=stop_requested)

    # ------------------------------------------------------------------------------------ step helpers
    def _no_sync(self, skip_sync: bool) -> contextlib.AbstractContextManager[Any]:
        if skip_sync and self.model is not self.module:
            ctx: contextlib.AbstractContextManager[Any] = self.model.no_sync()  # type: ignore[operator]
            return ctx
        return contextlib.nullcontext()

    def _is_layer_step(self, step: int) -> bool:
        k = self.recipe.telemetry.layer_stats_every
        return k > 0 and step % k == 0

    def _is_snapshot_step(self, step: int) -> bool:
        """The step before a layer-stats step: its update is the one that step's update ratio measures."""
        k = self.recipe.telemetry.layer_stats_every
        return k > 0 and (step + 1) % k == 0

    def _signals(self, step: int, rows: list[list[float]], layer_step: bool) -> StepSignals:
        """The same StepSignals on every rank: mean loss, worst grad norm, all-ranks finite flags."""
        n_ranks = len(rows)
        loss = sum(row[0] for row in rows) / n_ranks
        loss_ok = all(row[2] == 0 for row in rows)
        grads_ok = all(row[3] == 0 for row in rows)
        bad = [i for i, row in enumerate(rows) if row[2] or row[3]]
        worst = bad[0] if bad else max(range(n_ranks), key=lambda i: rows[i][1])
        grad_norm = rows[worst][1]
        ratios = [row[7] for row in rows if math.isfinite(row[7])]
        layer_norms = None
        if layer_step and len(rows[0]) > 8:
            layer_norms = [max(row[8 + j] for row in rows) for j in range(len(rows[0]) - 8)]
        return StepSignals(
            step=step,
            loss=loss,
            grad_norm=grad_norm,
            finite=loss_ok and grads_ok,
            loss_scale=rows[0][5] if self.fp16_dynamic else None,
            overflow=self.fp16_dynamic and not grads_ok,
            layer_grad_norms=layer_norms,
            update_ratio=max(ratios) if ratios else None,
            rank=worst,
        )

    def _record(self, step: int, s: StepSignals, decision: Decision, applied: bool, lr: float, post_norm: float,
                layer_norms: Tensor | None) -> None:
        res = self.result
        res.losses.append(s.loss)
        res.grad_norms.append(s.grad_norm)
        res.loss_scales.append(s.loss_scale)
        self._last_loss = s.loss
        if not applied and not decision.rollback:
            res.skipped_steps.append(step)
        elif not decision.findings:
            self._healthy_norms.append(s.grad_norm)
        for f in decision.findings:
            res.findings.append(f.to_event())
            if f.kind == "loss_scale_collapse":
                res.loss_scale_collapsed = True
        self._findings_since_checkpoint += len(decision.findings)
        now = time.perf_counter()
        elapsed, self._last_time = now - self._last_time, now
        if self.sink is None:
            return
        for f in decision.findings:
            self.sink.emit("anomaly", f.to_event())
        self.sink.emit("metric", {
            "step": step,
            "loss": finite_or_none(s.loss),
            "grad_norm": finite_or_none(s.grad_norm),
            "grad_norm_clipped": finite_or_none(post_norm) if applied else None,
            "lr": lr,
            "loss_scale": s.loss_scale if s.loss_scale is not None else (
                self.recipe.precision.static_scale if self.scaler.enabled else None),
            "throughput": self._samples_per_step / elapsed if elapsed > 0 else None,
            "skipped": not applied,
        })
        if layer_norms is not None:
            names = [n for n, _ in self.named_params]
            per_layer = {n: finite_or_none(v) for n, v in per_layer_norms(names, layer_norms).items()}
            threshold = self.recipe.detectors.vanishing.depth_slope_threshold
            self.sink.emit("layer_stats", {
                "step": step,
                "layer_grad_norms": per_layer,
                "block_grad_norms": s.layer_grad_norms,
                "update_ratio": finite_or_none(s.update_ratio),
                "diagnosis": diagnose_depth(s.layer_grad_norms, threshold) if s.layer_grad_norms else None,
            })

    def _diverged(self, report: _StepReport) -> None:
        res = self.result
        deciding = [f for f in report.decision.findings if f.action is Action.rollback]
        first: Finding | None = deciding[0] if deciding else None
        res.outcome = "diverged"
        res.final_step = report.step
        res.onset_step = report.decision.onset_step
        if first is not None:
            res.detector, res.value = first.kind, first.value
            res.reason = (f"{first.kind} at step {report.step} (onset {res.onset_step}): value {first.value} vs "
                          f"threshold {first.threshold}; rolled back")

    # ------------------------------------------------------------------------------------- checkpoints
    def checkpoint(self, step: int) -> SavedCheckpoint | None:
        """Write the full training state after ``step`` completed steps, with a health verdict."""
        ctx = self.ctx
        weights_finite = bool(torch.isfinite(torch.stack(torch._foreach_norm(
            [p.detach() for p in self.module.parameters()]))).all()) if self.params else True
        loss_ok = self.detectors.loss_in_bounds(self._last_loss)
        verdict = {
            "weights_finite": weights_finite,
            "anomalies_since_previous": self._findings_since_checkpoint,
            "loss_in_bounds": loss_ok,
            "loss": finite_or_none(self._last_loss),
        }
        healthy = weights_finite and loss_ok and self._findings_since_checkpoint == 0
        self._findings_since_checkpoint = 0
        # per-rank state (RNG streams, PowerSGD's error feedback) is gathered so each rank resumes its own
        mine = {"rng": rng_state(),
                "comm_hook": _powersgd_state_dict(self.comm_state) if self.comm_state is not None else {}}
        per_rank: list[Any] = [mine]
        if ctx.distributed:
            per_rank = [None] * ctx.world_size
            dist.all_gather_object(per_rank, mine)
        pending = self._pending_update_ratio
        name = f"step_{step:08d}"
        saved: SavedCheckpoint | None = None
        if ctx.is_main:
            state = {
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "detectors": self.detectors.state_dict(),
                "clipper": self.clipper.state_dict(),
                "comm_hook": [r["comm_hook"] for r in per_rank],
                "rng": [r["rng"] for r in per_rank],
                "progress": {"step": step, "data_offset": self.spec.data_offset, "attempt": self.spec.attempt,
                             "world_size": ctx.world_size,
                             "pending_update_ratio": None if pending is None else float(pending)},
            }
            meta = {"step": step, "healthy": healthy, "verdict": verdict, "attempt": self.spec.attempt,
                    "run_id": self.spec.run_id, "recipe": self.recipe.name}
            target_root = Path(tempfile.mkdtemp(prefix="ballast-ckpt-")) if ctx.ray_train else Path(
                self.spec.checkpoint_dir)
            info = save_checkpoint(target_root / name, state, meta=meta, overwrite=True)
            uri = (f"{ctx.checkpoint_uri_prefix.rstrip('/')}/{name}" if ctx.ray_train and ctx.checkpoint_uri_prefix
                   else str(info.path))
            saved = SavedCheckpoint(step=step, path=uri, healthy=healthy, sha256=info.sha256)
            self.result.checkpoints.append(saved)
            self._emit("checkpoint", {"step": step, "uri": uri, "sha256": info.sha256, "healthy": healthy,
                                      "verdict": verdict, "metrics": {"loss": finite_or_none(self._last_loss)}})
            if self.sink is not None:
                self.sink.flush()
            if ctx.ray_train:
                self._report_to_ray(step, name, info.path, healthy)
                shutil.rmtree(target_root, ignore_errors=True)
                self.faults.after_checkpoint(step, _local_path(uri))
            else:
                self.faults.after_checkpoint(step, info.path)
                apply_retention(self.spec.checkpoint_dir, self.recipe.checkpoint.keep,
                                self.recipe.checkpoint.keep_healthy)
        elif ctx.ray_train:
            self._report_to_ray(step, name, None, healthy)
        if ctx.distributed and not ctx.ray_train:
            dist.barrier()  # every rank may now read the checkpoint
        return saved

    def _report_to_ray(self, step: int, name: str, path: Path | None, healthy: bool) -> None:
        import ray.train

        metrics = {"step": step, "healthy": healthy, "loss": finite_or_none(self._last_loss),
                   "attempt": self.spec.attempt}
        checkpoint = ray.train.Checkpoint.from_directory(str(path)) if path is not None else None
        ray.train.report(metrics, checkpoint=checkpoint, checkpoint_dir_name=name)

    def _emit(self, type: str, data: dict[str, Any]) -> None:
        if self.sink is not None:
            self.sink.emit(type, data)


def _local_path(uri: str) -> Path | None:
    """The local directory of a checkpoint URI, if it is on this machine's file system."""
    if uri.startswith("file://"):
        uri = uri[len("file://"):]
    if "://" in uri:
        return None
    path = Path(uri)
    return path if path.is_dir() else None


@contextlib.contextmanager
def _materialize(uri: str | None) -> Iterator[str | None]:
    """A local directory for a checkpoint path or URI (downloaded through Ray Train for remote storage)."""
    if uri is None:
        yield None
        return
    local = _local_path(uri)
    if local is not None or "://" not in uri:
        yield str(local if local is not None else uri)
        return
    import ray.train

    with ray.train.Checkpoint(uri).as_directory() as path:
        yield str(path)


# ------------------------------------------------------------------------------------------ entry points
def _next_spec(spec: AttemptSpec, plan: Mapping[str, Any]) -> AttemptSpec:
    """The next attempt from an in-place plan: either a full spec or overrides on the current recipe."""
    if plan.get("spec"):
        return AttemptSpec.from_dict(plan["spec"])
    recipe = apply_overrides(spec.recipe, plan.get("overrides") or {},
                             allowed_import_modules=spec.allowed_import_modules or None)
    return AttemptSpec(
        recipe=recipe, checkpoint_dir=str(plan.get("checkpoint_dir") or spec.checkpoint_dir),
        attempt=int(plan["attempt"]), resume_from=plan.get("resume_from"),
        rewarm_steps=int(plan.get("rewarm_steps", 0)), data_offset=int(plan.get("data_offset", spec.data_offset)),
        run_id=spec.run_id, allowed_import_modules=spec.allowed_import_modules,
    )


def _run(spec: AttemptSpec, ctx: WorkerContext, sink: EventSink | None, resume: str | None) -> AttemptOutcome:
    """Run attempts in this worker group: the spec's, then any in-place recovery plan the sink hands back."""
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    history: list[AttemptOutcome] = []
    try:
        while True:
            with _materialize(resume) as resume_dir:
                trainer = GuardedTrainer(spec, ctx, sink, resume_dir=resume_dir)
            result = trainer.train()
            plan: dict[str, Any] | None = None
            if result.outcome == "diverged" and spec.recipe.recovery.in_place:
                if ctx.is_main and sink is not None and callable(getattr(sink, "request_plan", None)):
                    plan = sink.request_plan(result.end_event())  # type: ignore[attr-defined]
                plan = _broadcast_object(plan, ctx)
            if not plan:
                result.previous = history
                return result
            history.append(result)
            spec = _next_spec(spec, plan)
            resume = spec.resume_from
    finally:
        torch.use_deterministic_algorithms(deterministic_before)


def run_attempt(spec: AttemptSpec, sink: EventSink | None = None) -> AttemptOutcome:
    """Run one attempt in this process (world size 1, or the ranks of an initialised process group)."""
    ctx = _plain_context(spec.recipe)
    Path(spec.checkpoint_dir).mkdir(parents=True, exist_ok=True)
    return _run(spec, ctx, sink, spec.resume_from)


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """Ray Train V2 entry: ``config = {"spec": AttemptSpec dict, "sink": EventSink | None,
    "checkpoint_uri_prefix": str}``. Checkpoints go through ``ray.train.report`` (rank 0 attaches them);
    telemetry through the sink (used on rank 0 only)."""
    import ray.train
    import ray.train.torch

    spec = AttemptSpec.from_dict(config["spec"])
    tc = ray.train.get_context()
    ctx = WorkerContext(
        rank=tc.get_world_rank(), world_size=tc.get_world_size(), device=ray.train.torch.get_device(),
        ray_train=True, checkpoint_uri_prefix=config.get("checkpoint_uri_prefix"),
    )
    sink = config.get("sink") if ctx.is_main else None
    restored = ray.train.get_checkpoint()
    if restored is not None:  # Ray Train restarted this worker group: continue from its newest checkpoint
        with restored.as_directory() as path:
            _run(spec, ctx, sink, str(path))
        return
    _run(spec, ctx, sink, spec.resume_from)


__all__ = [
    "AttemptOutcome",
    "AttemptSpec",
    "EngineConfigError",
    "GuardedTrainer",
    "SavedCheckpoint",
    "WorkerContext",
    "run_attempt",
    "train_loop_per_worker",
]
