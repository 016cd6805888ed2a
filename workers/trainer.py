"""The guarded training loop: apply a recipe, watch every step, checkpoint with a health verdict.

Read it top to bottom: ``GuardedTrainer.train()`` → ``train_step()``. Each step:

1. LR from the schedule (set on the param groups directly; re-warmed after a resume when the plan says so);
2. forward/backward over the micro-batches under autocast with the loss scaler (DDP syncs gradients only on the
   last micro-batch), with the recipe's faults injected where they would strike;
3. unscale, fused per-tensor grad norms, clipping (in place; a skipped update discards the clipped grads anyway);
4. **one all-gather of every rank's signals packet** (``workers/signals.py``): the only host sync of an ordinary
   step, from which every rank derives the same ``StepSignals`` and so the same decision;
5. the guard: detectors → ``optimizer.step()`` **only** when loss and gradients are finite on every rank and the
   decision is ``record``; ``skip_step`` and non-finite steps zero the grads (but the second and later steps of
   a run of finite skips apply their update clipped to the healthy norm: ``Decision.clip_to``); ``rollback``
   ends the attempt;
6. telemetry through the sink (rank 0 only; never blocks), checkpoints every ``checkpoint.every_steps`` (the
   loop pays for the copy to host memory; the write runs in the background, ``workers/checkpoint_writer.py``).

With ``training.eval_interval`` the loop also evaluates the held-out loss (``_evaluate``) at the attempt's start,
every that-many completed steps and after the last one (before that step's checkpoint, which records it, and the
outcome verdict, which reads it), and where an attempt that ends early ends. An eval touches neither the weights,
the training RNG nor the data stream, so the training trajectory is bit-identical with and without it.

The components it calls live in their own modules: clipping, precision, schedule, detectors, faults, comm hooks
(``comm``), checkpoint contents (``checkpointing``). ``workers/entry.py`` runs it in a process or on Ray Train.

Why one file of ~450 lines: it is the step, read top to bottom, and its methods share one attempt's state
(model, optimizer, scaler, detector suite, result); every computation with a rule of its own already lives in
the modules above, and what is left here is the order in which they run.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from contracts.checkpoint import Manifest
from contracts.recipe import Action, DType, LossScaling
from contracts.wire import AttemptOutcome, AttemptSpec, finite_or_none
from workers.checkpoint import load_checkpoint, rng_state, set_rng_state
from workers.checkpointing import Checkpointer, TrainingState, health_verdict
from workers.clipping import (
    Clipper,
    block_grad_norms,
    block_members,
    global_norm,
    grad_norms,
    param_snapshot,
    update_ratio,
)
from workers.comm import check_backend, no_sync, prime_ddp_buckets, wrap_ddp
from workers.context import WorkerContext, gather_rows
from workers.data import DataSource, build_data, to_device
from workers.detectors import Decision, DetectorSuite, Finding, StepSignals
from workers.evaluation import EvalHistory, eval_due
from workers.faults import FaultInjector
from workers.models import apply_distributed, build_model, param_block_index
from workers.objective import Objective
from workers.optim import build_optimizer, hyperparameters
from workers.precision import LossScaler
from workers.schedule import lr_at
from workers.sharded_checkpoint import load_shards, shards_of
from workers.sharding import check_full_resume, fsdp_enabled, shard_model
from workers.signals import GatheredStep, RankSignals, combine, gather
from workers.sinks import EventSink
from workers.telemetry import layer_stats_payload, metric_payload
from workers.verdict import (
    COLLAPSE_BASELINE_STEPS,
    EvalEvidence,
    Evidence,
    StallClock,
    Verdict,
    collapse_window,
    early_check_step,
    final_loss,
    final_stats,
    judge_collapse,
    judge_end,
    judge_progress,
    judge_stall,
    stall_steps,
)


def _num(x: float | None) -> str:
    """A detector's number for a reason line: 4 significant digits (``9.579``, not ``9.578632354736328``)."""
    return "n/a" if x is None else format(x, ".4g")


STOPPED = "stop requested"
"""Why an LR probe's candidate (``GuardedTrainer.probe``) ended early when the control plane asked to stop."""


@dataclass
class StepReport:
    step: int
    signals: StepSignals
    decision: Decision
    applied: bool
    """Whether ``optimizer.step()`` ran."""
    stop: bool
    """Some rank was asked to stop the attempt."""


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
        check_backend(r, ctx)
        if r.training.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)

        self.data: DataSource = build_data(
            r.data, seed=r.training.seed, batch_size=r.training.batch_size, rank=ctx.rank,
            world_size=ctx.world_size, allowed_import_modules=spec.allowed_import_modules,
        )
        self.module: nn.Module = self._build_model()
        self.objective = Objective(self.module, r.loss, dtype=r.precision.dtype, device=self.device,
                                   allowed_import_modules=spec.allowed_import_modules)
        """How a batch becomes the loss (``objective.loss(batch)``): the training step, DDP priming and eval."""

        saved: dict[str, Any] | None = None
        manifest: Manifest | None = None
        self.start_step = 0
        if resume_dir is not None:
            saved, manifest = load_checkpoint(resume_dir)
            self.start_step = manifest.step
            if "model" in saved:  # a sharded checkpoint's weights come back with the optimizer (load_shards)
                check_full_resume(r, ctx)
                self.module.load_state_dict(saved["model"])
        else:  # a fresh start seeds the global RNG per rank (dropout in custom models); a resume restores it
            torch.manual_seed(r.training.seed * 1009 + ctx.rank)

        self.model: nn.Module = self.module
        self.comm_state: Any = None
        if ctx.distributed and fsdp_enabled(r):
            shard_model(self.module, self.device)  # in place: the module is the model, its parameters DTensors
        elif ctx.distributed:
            self.model, self.comm_state = wrap_ddp(self.module, r, self.device)
        self.named_params = [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]
        self.params = [p for _, p in self.named_params]
        self._block_members = self._block_membership()
        self.optimizer = build_optimizer(self.named_params, r.optimizer, self.module)
        self.scaler = LossScaler(r.precision, self.device)
        self.clipper = Clipper(r.clipping, self.named_params)
        self.fp16_dynamic = r.precision.dtype is DType.fp16 and r.precision.loss_scaling is LossScaling.dynamic
        self.detectors = DetectorSuite(r.detectors, fp16=self.fp16_dynamic)
        self.faults = FaultInjector(r.faults, attempt=spec.attempt, rank=ctx.rank)
        self.evals = EvalHistory() if r.training.eval_interval > 0 else None
        self.stall_clock = StallClock()
        """The lineage's stall clock (``verdict.StallClock``), restored on resume."""
        self.state = TrainingState(self.module, self.optimizer, self.scaler, self.detectors, self.clipper,
                                   self.stall_clock, self.comm_state, self.evals)
        self.checkpointer = Checkpointer(spec, ctx, self.sink, self.faults)

        self._pending_update_ratio: Tensor | None = None
        self._fixed_lr: float | None = None
        """The LR probe's constant LR (``probe``); None: the schedule's."""
        if saved is not None:
            if manifest is not None and shards_of(manifest) is not None:
                load_shards(resume_dir, manifest, self.module, self.optimizer)  # type: ignore[arg-type]
            self._restore(saved)
        else:
            self._measure_untrained()

        self.result = AttemptOutcome(outcome="succeeded", attempt=spec.attempt, start_step=self.start_step,
                                     final_step=self.start_step)
        self._healthy_norms: list[float] = []
        self._findings_since_checkpoint = 0
        self._last_loss = float("nan")
        self._last_time = time.perf_counter()
        self._samples_per_step = r.training.batch_size * r.training.grad_accum_steps * ctx.world_size
        warmup = r.schedule.resolved_warmup_steps(r.training.max_steps)
        self._early_check = early_check_step(r.success, max_steps=r.training.max_steps, warmup_steps=warmup)
        self._stall_steps = stall_steps(r.success, max_steps=r.training.max_steps,
                                        ema_alpha=r.detectors.loss_spike.ema_alpha)
        self._collapse_window = collapse_window(r.detectors.loss_spike.ema_alpha)
        self._loss_floor = r.success.loss_floor if r.success.loss_floor is not None else self.data.loss_floor
        """The floor the verdict measures progress toward: the recipe's, else the data's own (None: unknown)."""
        self._measured_trivial: tuple[float | None] | None = None
        """The trivial loss measured on a user dataset's training targets, once (``_trivial_loss``)."""
        collapse_on = r.success.collapse_ratio is not None and self._loss_floor is not None and self.start_step == 0
        self._collapse_last_step = r.training.max_steps // 2 if collapse_on else -1
        """The last step the gradient-collapse rule can fire at (-1: never): a fresh start's first half, with a floor.
        Only a fresh start has its first steps' gradient norms to compare with."""

    # ------------------------------------------------------------------------------------------ train
    def train(self) -> AttemptOutcome:
        """Run steps until max_steps, a rollback decision, or a stop request; wait for the checkpoint write in
        flight; then emit ``end``."""
        max_steps = self.recipe.training.max_steps
        every = self.recipe.checkpoint.every_steps
        res = self.result
        try:
            self._train_steps(max_steps, every)
            self.checkpointer.drain()  # the result and the end event list only written, verified checkpoints
        finally:
            self.checkpointer.close()
        res.median_grad_norm = statistics.median(self._healthy_norms) if self._healthy_norms else None
        if self.sink is not None:
            self.sink.emit("end", res.end_event())
            self.sink.flush()
        return res

    def probe(self, steps: int) -> tuple[list[float], str | None]:
        """One candidate of the LR probe (``workers/lr_probe.py``): train up to ``steps`` steps from the start at
        the recipe's LR held constant where the attempt would train once warmed up (the schedule's LR at the end of
        the warmup and of the re-warm), with the detectors and faults of a real step but no checkpoint, eval,
        verdict or telemetry. Returns the steps' losses and why the run was cut short: an anomaly the detectors
        would roll back, a non-finite step, or a stop request (``STOPPED``); None: it was not. Build a fresh trainer
        for each candidate."""
        r = self.recipe
        max_steps = r.training.max_steps
        warmed = max(self.start_step + self.spec.rewarm_steps, r.schedule.resolved_warmup_steps(max_steps))
        self._fixed_lr = lr_at(min(warmed, max_steps - 1), base_lr=r.optimizer.lr, max_steps=max_steps,
                               schedule=r.schedule)
        losses: list[float] = []
        try:
            for step in range(self.start_step, min(self.start_step + steps, max_steps)):
                report = self.train_step(step)
                losses.append(report.signals.loss)
                if report.decision.rollback:
                    kinds = [f.kind for f in report.decision.findings if f.action is Action.rollback]
                    return losses, f"{kinds[0] if kinds else 'rollback'} at step {step}"
                if not report.signals.finite:
                    return losses, f"non-finite at step {step}"
                if report.stop:
                    return losses, STOPPED
        finally:
            self.checkpointer.close()
        return losses, None

    def _train_steps(self, max_steps: int, every: int) -> None:
        res = self.result
        self._evaluate_unless_done(self.start_step)
        for step in range(self.start_step, max_steps):
            self.checkpointer.poll()  # register the background write once it is done
            report = self.train_step(step)
            if report.decision.rollback:
                self._diverged(report)
                break
            res.final_step = step + 1
            if report.stop:
                res.outcome, res.reason = "cancelled", f"stop requested; ended after step {step}"
                break
            if self.evals is not None and (eval_due(res.final_step, self.recipe.training.eval_interval)
                                           or res.final_step == max_steps):
                self._evaluate(res.final_step)  # the last step too: its checkpoint and the verdict read it
            if step == self._early_check and not self._judged(self._early_verdict(step)):
                break
            if not self._judged(self._stall_verdict(res.final_step)):
                break
            if not self._judged(self._collapse_verdict(res.final_step)):
                break
            if res.final_step % every == 0 or res.final_step == max_steps:
                self.checkpoint(res.final_step)
        else:
            # reaching max_steps is not success: the model must be healthy where it ends
            verdict = judge_end(self.recipe.success, self._evidence(), step=max_steps, stall_patience=self._stall_steps)
            if self._judged(verdict):
                res.reason = f"completed {max_steps} steps; {verdict.reason}"
        self._evaluate_unless_done(res.final_step)  # an attempt that ended early: where it ended

    def train_step(self, step: int) -> StepReport:
        self.faults.before_step(step)
        lr = self._set_lr(step)

        # 1. forward and backward over the micro-batches; DDP all-reduces only on the last one
        mean_loss = self._forward_backward(step)

        # 2. unscale, fused norms, clip (in place; a skipped step throws the grads away below)
        self.scaler.unscale_(self.optimizer)
        self.faults.on_grads(step, self.params)
        norms = grad_norms(self.params)
        pre = global_norm(norms).to(self.device)
        layer_step = self._is_layer_step(step)
        block_norms = block_grad_norms(norms.to(self.device), self._block_members) if layer_step else None
        post = self.clipper.clip(norms)

        # 3. one gather of every rank's signals: the only host sync of an ordinary step
        stop = self.sink is not None and self.sink.should_stop()
        ratio, self._pending_update_ratio = self._pending_update_ratio, None
        packet = RankSignals(
            loss=mean_loss,
            grad_norm=pre,
            loss_nonfinite=(~torch.isfinite(mean_loss)).float(),
            grads_nonfinite=(~torch.isfinite(pre)).float(),
            stop=torch.tensor(float(stop), device=self.device),
            loss_scale=self.scaler.scale_tensor().to(self.device).float(),
            clipped_norm=post.to(self.device).float(),
            update_ratio=ratio if ratio is not None else torch.tensor(float("nan"), device=self.device),
            block_norms=() if block_norms is None else tuple(block_norms.unbind(0)),
        )
        gathered = combine(step, gather(packet, self.ctx), fp16_dynamic=self.fp16_dynamic, layer_step=layer_step)
        signals = gathered.signals

        # 4. the guard: the detectors decide; the weights change only if every rank's numbers are finite
        decision = self.detectors.observe(signals)
        apply = signals.finite and (decision.action is Action.record or decision.clip_to is not None)
        if apply and decision.clip_to is not None:  # a recurring spike: the weights' fault, a bounded update
            self.clipper.scale_to(decision.clip_to, gathered.clipped_norm)
        snapshot = param_snapshot(self.params) if apply and self._is_snapshot_step(step) else None
        if apply:
            self.optimizer.step()
        if not decision.rollback:
            self.scaler.update(signals.overflow or not signals.finite)
        self.optimizer.zero_grad(set_to_none=True)
        if snapshot is not None:
            self._pending_update_ratio = update_ratio(snapshot, self.params).to(self.device)

        # 5. bookkeeping and telemetry (rank 0 only)
        self._tally(signals, decision, apply)
        self._emit_step(gathered, decision, apply, lr, norms if layer_step else None)
        return StepReport(step=step, signals=signals, decision=decision, applied=apply,
                          stop=gathered.stop_requested)

    # ------------------------------------------------------------------------------------ step helpers
    def _set_lr(self, step: int) -> float:
        r = self.recipe
        lr = self._fixed_lr
        if lr is None:
            lr = lr_at(step, base_lr=r.optimizer.lr, max_steps=r.training.max_steps, schedule=r.schedule,
                       rewarm_start=self.start_step if self.spec.rewarm_steps else None,
                       rewarm_steps=self.spec.rewarm_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def _forward_backward(self, step: int) -> Tensor:
        """The mean loss over the step's micro-batches (0-dim, on the device); the grads hold its gradient."""
        r = self.recipe
        accum = r.training.grad_accum_steps
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        for micro in range(accum):
            index = (step + self.spec.data_offset) * accum + micro
            batch = to_device(self.faults.on_batch(step, self.data.batch(index)), self.device)
            with no_sync(self.model, self.module, skip_sync=micro < accum - 1):
                loss = self.objective.loss(batch, model=self.model)  # autocast forward, fp32 loss
                loss = self.faults.on_loss(step, loss, batch)
                self.scaler.scale(loss / accum).backward()  # type: ignore[no-untyped-call]
            loss_sum += loss.detach().float()
        return loss_sum / accum

    def _is_layer_step(self, step: int) -> bool:
        k = self.recipe.telemetry.layer_stats_every
        return k > 0 and step % k == 0

    def _is_snapshot_step(self, step: int) -> bool:
        """The step before a layer-stats step: its update is the one that step's update ratio measures."""
        k = self.recipe.telemetry.layer_stats_every
        return k > 0 and (step + 1) % k == 0

    def _tally(self, s: StepSignals, decision: Decision, applied: bool) -> None:
        """The attempt's record of the step (every rank keeps the same one)."""
        res = self.result
        res.losses.append(s.loss)
        res.grad_norms.append(s.grad_norm)
        res.loss_scales.append(s.loss_scale)
        self._last_loss = s.loss
        if not applied and not decision.rollback:
            res.skipped_steps.append(s.step)
        elif not decision.findings:
            self._healthy_norms.append(s.grad_norm)
        for f in decision.findings:
            res.findings.append(f.to_event())
            if f.kind == "loss_scale_collapse":
                res.loss_scale_collapsed = True
        self._findings_since_checkpoint += len(decision.findings)

    def _emit_step(self, gathered: GatheredStep, decision: Decision, applied: bool, lr: float,
                   layer_norms: Tensor | None) -> None:
        """The step's anomalies, ``metric`` and (on layer-stats steps) ``layer_stats`` events."""
        now = time.perf_counter()
        elapsed, self._last_time = now - self._last_time, now
        if self.sink is None:
            return
        s = gathered.signals
        for f in decision.findings:
            self.sink.emit("anomaly", f.to_event())
        static_scale = self.recipe.precision.static_scale if self.scaler.enabled else None
        self.sink.emit("metric", metric_payload(
            s, applied=applied, lr=lr,
            clipped_norm=gathered.clipped_norm if decision.clip_to is None else min(gathered.clipped_norm,
                                                                                    decision.clip_to),
            loss_scale=s.loss_scale if s.loss_scale is not None else static_scale,
            throughput=self._samples_per_step / elapsed if elapsed > 0 else None,
        ))
        if layer_norms is not None:
            self.sink.emit("layer_stats", layer_stats_payload(
                s, names=[n for n, _ in self.named_params], layer_norms=layer_norms,
                depth_slope_threshold=self.recipe.detectors.vanishing.depth_slope_threshold,
            ))

    def _diverged(self, report: StepReport) -> None:
        res = self.result
        deciding = [f for f in report.decision.findings if f.action is Action.rollback]
        first: Finding | None = deciding[0] if deciding else None
        res.outcome = "diverged"
        res.final_step = report.step
        res.onset_step = report.decision.onset_step
        if first is not None:
            res.detector, res.value = first.kind, first.value
            res.reason = (f"{first.kind} detected at step {report.step}, onset at step {res.onset_step}: value "
                          f"{_num(first.value)} vs threshold {_num(first.threshold)}; rolled back")

    # ------------------------------------------------------------------------------------- evaluation
    def _evaluate_unless_done(self, step: int) -> None:
        """Evaluate the weights after ``step`` completed steps, unless eval is off or they were just evaluated."""
        if self.evals is not None and self.evals.last_step != step:
            self._evaluate(step)

    def _evaluate(self, step: int) -> float:
        """The held-out loss of the weights after ``step`` completed steps: the mean over ``training.eval_batches``
        held-out batches (``data.eval_batch(i)``, the same ones every time) on every rank, averaged over the ranks
        with one all-gather (a collective: every rank calls it at the same steps, so every rank holds the same
        number and makes the same verdict). Forward only, under ``no_grad`` and in eval mode, with the training
        autocast; the RNG state is restored after (eval draws neither training randomness nor training batches)."""
        r = self.recipe
        batches = r.training.eval_batches
        modes = [(m, m.training) for m in self.model.modules()]  # the DDP wrapper too
        saved_rng = rng_state()
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        try:
            self.model.eval()
            with torch.no_grad():
                for i in range(batches):
                    loss_sum += self.objective.loss(self.data.eval_batch(i), self.model).detach().float()
        finally:
            for m, training in modes:
                m.training = training
            set_rng_state(saved_rng)
        rows = gather_rows((loss_sum / batches).reshape(1), self.ctx)
        value = sum(row[0] for row in rows) / len(rows)
        assert self.evals is not None
        self.evals.observe(step, value)
        payload = {"step": step, "eval_loss": finite_or_none(value), "batches": batches * self.ctx.world_size}
        self.result.evals.append(payload)
        if self.sink is not None:
            self.sink.emit("eval", payload)
        return value

    def _measure_untrained(self) -> None:
        """A fresh start's baseline for the loss detector's untrained-ratio rule: the untrained model's loss on the
        batches of the first ``untrained_steps`` steps (the very batches those steps will train on, with the data
        faults a step would see), computed as a step computes its loss (training mode, autocast, the mean over the
        micro-batches and the ranks: one all-gather), forward only. The RNG state and the module's buffers (batch
        norm's running statistics move in training mode) are restored after, so the run trains exactly as it would
        without the measurement."""
        cfg = self.recipe.detectors.loss_spike
        steps = min(cfg.untrained_steps, self.recipe.training.max_steps)
        if not cfg.enabled or cfg.max_untrained_ratio is None or steps == 0:
            return
        accum = self.recipe.training.grad_accum_steps
        saved_rng = rng_state()
        buffers = [(b, b.detach().clone()) for b in self.module.buffers()]
        losses = torch.zeros(steps, dtype=torch.float32, device=self.device)
        try:
            with torch.no_grad():
                for step in range(steps):
                    for micro in range(accum):
                        index = (step + self.spec.data_offset) * accum + micro
                        batch = to_device(self.faults.on_batch(step, self.data.batch(index)), self.device)
                        loss = self.faults.on_loss(step, self.objective.loss(batch), batch)
                        losses[step] += loss.detach().float() / accum
        finally:
            set_rng_state(saved_rng)
            with torch.no_grad():
                for buffer, before in buffers:
                    buffer.copy_(before)
        rows = gather_rows(losses, self.ctx)
        self.detectors.loss_spike.set_untrained([sum(col) / len(rows) for col in zip(*rows, strict=True)])

    # --------------------------------------------------------------------------------------- verdict
    def _evidence(self) -> Evidence:
        summary = self.detectors.loss_summary()
        final, sem = final_stats(self.result.losses, self.recipe.success.window, start_step=self.start_step,
                                 skipped=self.result.skipped_steps)
        return Evidence(
            final_loss=final, final_sem=sem,
            best_loss=summary.best, best_step=summary.best_step, initial_loss=summary.initial,
            loss_floor=self._loss_floor, trivial_loss=self._trivial_loss(), noise_std=summary.noise_std,
            vanishing=any(f["kind"] == "vanishing_gradients" for f in self.result.findings),
            start_step=self.start_step,
            progress_step=None if self.stall_clock.mark is None else self.stall_clock.mark[0],
            stalled_for=self.stall_clock.longest, stalled_from=self.stall_clock.longest_from,
            eval=self._eval_evidence(summary.initial),
        )

    def _eval_evidence(self, initial: float | None) -> EvalEvidence | None:
        """The eval series' evidence with the training loss where the eval loss was best (``train_at_best``)."""
        held_out = None if self.evals is None else self.evals.evidence()
        if held_out is None or held_out.best_step is None:
            return held_out
        best, res = held_out.best_step, self.result
        if best == 0:
            before: float | None = initial
        elif best <= self.start_step:
            before = None  # an earlier attempt's steps
        else:
            before = final_loss(res.losses[: best - self.start_step], self.recipe.success.window,
                                start_step=self.start_step, skipped=res.skipped_steps)
        return replace(held_out, train_at_best=before)

    def _trivial_loss(self) -> float | None:
        """What learning nothing scores: the data's own figure, else the best input-free guess's loss on the
        training targets under the run's loss (a user's dataset; measured once, at the first verdict that reads
        it, the same on every rank), else None."""
        if self.data.trivial_loss is not None:
            return self.data.trivial_loss
        if self._measured_trivial is None:
            targets = self.data.training_targets()
            self._measured_trivial = (None if targets is None else self.objective.trivial_loss(targets),)
        return self._measured_trivial[0]

    def _early_verdict(self, step: int) -> Verdict:
        smoothed = self.detectors.loss_summary().smoothed
        if smoothed is None:
            return Verdict(None, "no loss seen yet")
        return judge_progress(self.recipe.success, smoothed_loss=smoothed, ev=self._evidence(), step=step)

    def _stall_verdict(self, step: int) -> Verdict:
        """The stall rule after ``step`` completed steps; cheap until the best is ``_stall_steps`` old."""
        if self._stall_steps is None or self._loss_floor is None:
            return Verdict(None, "off")
        summary = self.detectors.loss_summary()
        cfg = self.recipe.success
        clock = self.stall_clock
        clock.tick(step, best_step=summary.best_step, best_loss=summary.best, initial=summary.initial,
                   floor=self._loss_floor, min_gain=cfg.stall_min_gain, max_progress=cfg.stall_max_progress)
        if clock.mark is None or step - max(clock.mark[0], self.start_step) < self._stall_steps:
            return Verdict(None, "improving")
        return judge_stall(cfg, self._evidence(), step=step, patience=self._stall_steps)

    def _collapse_verdict(self, step: int) -> Verdict:
        """The gradient-collapse rule after ``step`` completed steps; nothing is gathered outside its window."""
        window = self._collapse_window
        if not max(window, COLLAPSE_BASELINE_STEPS) <= step <= self._collapse_last_step:
            return Verdict(None, "not applicable")
        res = self.result
        skipped = set(res.skipped_steps)

        def finite(values: list[float], first: int) -> list[float]:  # values[i] is step first + i
            return [v for i, v in enumerate(values, start=first) if math.isfinite(v) and i not in skipped]

        baseline = finite(res.grad_norms[:COLLAPSE_BASELINE_STEPS], 0)
        return judge_collapse(
            self.recipe.success, step=step, max_steps=self.recipe.training.max_steps,
            baseline_norm=statistics.median(baseline) if baseline else None,
            norms=finite(res.grad_norms[step - window:step], step - window),
            losses=[x for x in res.losses[step - window:step] if math.isfinite(x)],
            initial_loss=self.detectors.loss_summary().initial, loss_floor=self._loss_floor,
        )

    def _judged(self, verdict: Verdict) -> bool:
        """True when the verdict is healthy; otherwise the attempt ends as diverged with the verdict's kind (the
        recovery policy reads it), and the verdict is recorded as an anomaly like any detector's finding."""
        if verdict.healthy:
            return True
        res = self.result
        onset = verdict.onset_step if verdict.onset_step is not None else self.start_step
        res.outcome, res.detector, res.value = "diverged", verdict.kind, verdict.value
        res.onset_step, res.reason = onset, verdict.reason
        finding = Finding(step=max(res.final_step - 1, 0), kind=str(verdict.kind), detector="verdict",
                          value=verdict.value, threshold=verdict.threshold, action=Action.rollback,
                          details={"onset_step": onset, "reason": verdict.reason})
        res.findings.append(finding.to_event())
        if self.sink is not None:
            self.sink.emit("anomaly", finding.to_event())
        return False

    # ------------------------------------------------------------------------------------- checkpoints
    def checkpoint(self, step: int) -> None:
        """Checkpoint the full training state after ``step`` completed steps, with a health verdict (every rank
        calls it). Returns once rank 0 holds a host-memory copy; the write goes on in the background and the
        checkpoint joins ``result.checkpoints`` once written and verified."""
        summary = self.detectors.loss_summary()
        healthy, verdict = health_verdict(self.module, loss=self._last_loss,
                                          loss_in_bounds=self.detectors.loss_in_bounds(self._last_loss),
                                          anomalies=self._findings_since_checkpoint, summary=summary,
                                          regression_tolerance=self.recipe.success.regression_tolerance,
                                          evals=self._fresh_evals(step),
                                          eval_regression_tolerance=self.recipe.success.eval_regression_tolerance)
        self._findings_since_checkpoint = 0
        pending = self._pending_update_ratio
        self.checkpointer.save(step, self.state, healthy=healthy, verdict=verdict, loss=self._last_loss,
                                      pending_update_ratio=None if pending is None else float(pending),
                                      on_saved=self.result.checkpoints.append)

    def _fresh_evals(self, step: int) -> EvalEvidence | None:
        """The eval series for the checkpoint's verdict, only when its newest eval measured these weights."""
        ev = None if self.evals is None else self.evals.evidence()
        return ev if ev is not None and ev.final_step == step else None

    # ------------------------------------------------------------------------------------------ setup
    def _build_model(self) -> nn.Module:
        r = self.recipe
        model = build_model(r.model, self.data, seed=r.training.seed,
                            allowed_import_modules=self.spec.allowed_import_modules, loss=r.loss)
        return apply_distributed(model, r.distributed).to(self.device)

    def _block_membership(self) -> list[Tensor]:
        """For each block, the indices of its trainable parameters in ``self.params`` (the grad-norm order)."""
        owner = param_block_index(self.module)
        if not owner:
            return []  # no blocks found: no per-layer profile
        return block_members([n for n, _ in self.named_params], owner, self.device)

    def _restore(self, saved: dict[str, Any]) -> None:
        """Resume everything but the weights (loaded before DDP wrapped the module)."""
        if self.comm_state is not None:
            accum = self.recipe.training.grad_accum_steps
            batch = self.data.batch((self.start_step + self.spec.data_offset) * accum)
            prime_ddp_buckets(self.model, self.module, self.objective, batch)
        ratio = self.state.load_state_dict(saved, hyperparameters=hyperparameters(self.recipe.optimizer),
                                           rank=self.ctx.rank, world_size=self.ctx.world_size, device=self.device)
        if ratio is not None:
            self._pending_update_ratio = torch.tensor(ratio, device=self.device)
