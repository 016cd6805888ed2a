"""Fresh scenarios: unstable runs written outside both halves, as a new user would write them, for a quick look
at divergences the benchmark does not hold. Each runs in this process through the ``ballast train`` loop
(``api.cli.local_run.LocalRun``: the same policy and verdict as the service, one torch thread like a service
worker), under ``none`` and ``ballast``, beside its reference (the same model and data at a safe LR).

``python -m benchmarks.divergence.fresh [NAME ...]`` prints one JSON line per scenario: outcome, final ÷ reference
(mean of the last 20 steps of the lineage's curve), steps executed ÷ max_steps and every attempt's changes.
A scenario that has been looked at is no longer fresh: BENCHMARKS.md says which were used to change what. With no
NAME the first set runs (also ``--set first``); ``--set 2026-12-05`` runs the second (``SCENARIOS_2026_12_05``: six
unstable recipes, three healthy controls), ``--set 2026-12-06``, ``--set 2026-12-06b`` and ``--set 2026-12-06c`` the
third to fifth (``SCENARIOS_2026_12_06``, ``..._06B``, ``..._06C``, the same shape), ``--set 2026-12-06d`` to
``--set 2026-12-06g`` the sixth to ninth (eight unstable, three controls each), ``--set 2026-12-07`` the tenth
(seven unstable, three controls), ``--set 2026-12-07b`` the eleventh (eight warmups to too-high peaks, two
controls), ``--set 2026-12-07c`` the twelfth (your own models, datasets and losses: seven unstable, one that
overfits, one with nothing to learn, two controls), ``--set 2026-12-07d`` the thirteenth (your own data read batch
by batch, a large lazy dataset, sequences, images: six unstable, two with nothing to learn, three controls),
``--set 2026-12-07e`` the fourteenth (the recipe's other settings on your own code: fp16, per-layer, adaptive and
z-score clipping, Nesterov, linear and constant schedules, accumulation, an eval series: eight unstable, three
controls); their names are also accepted one by one.
"""

from __future__ import annotations

import copy
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from api.cli.local_run import LocalRun
from api.cli.train_cmd import run_in_process
from benchmarks.divergence.cases import deep_merge
from benchmarks.divergence.metrics import final_loss, steps_executed
from contracts.recipe import Recipe
from contracts.recipe.imports import named_modules
from contracts.wire import AttemptSpec
from workers.data import build_data
from workers.data.synthetic import RegressionSource
from workers.sinks import ListSink

MARKOV = {"name": "markov", "vocab_size": 32, "seq_len": 16}


def _gpt(d_model: int = 64, **extra: Any) -> dict[str, Any]:
    return {"name": "tiny_gpt", "vocab_size": 32, "context": 16, "n_layers": 2, "n_heads": 2, "d_model": d_model,
            **extra}


def _recipe(model: dict[str, Any], data: dict[str, Any], optimizer: dict[str, Any], *, warmup: int = 0,
            clipping: dict[str, Any] | None = None, dtype: str | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "name": "fresh", "model": model, "data": data,
        "training": {"max_steps": 150, "batch_size": 16, "seed": 7},
        "optimizer": optimizer, "schedule": {"warmup_steps": warmup, "decay": "cosine"},
        "checkpoint": {"every_steps": 25}, "faults": [],
    }
    if clipping is not None:
        doc["clipping"] = clipping
    if dtype is not None:
        doc["precision"] = {"dtype": dtype}
    return doc


NO_CLIP = {"method": "none"}
SCENARIOS: dict[str, tuple[dict[str, Any], float]] = {
    # name: (unstable recipe, the reference's LR)
    "postln-adam": (_recipe(_gpt(norm_position="post"), MARKOV, {"name": "adam", "lr": 0.03}), 0.002),
    "gpt-sgd-momentum": (_recipe(_gpt(32), MARKOV, {"name": "sgd", "lr": 3.0, "momentum": 0.9}, clipping=NO_CLIP),
                         0.3),
    "gpt-wide-init": (_recipe(_gpt(init_std=0.3), MARKOV, {"name": "adamw", "lr": 0.01}), 0.001),
    "gpt-bf16-warmup20": (_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.06}, warmup=20, dtype="bf16"), 0.003),
    "mlp-relu-adam": (_recipe({"name": "deep_mlp", "depth": 10, "width": 64, "activation": "relu", "residual": False},
                              {"name": "regression", "dim": 16}, {"name": "adam", "lr": 0.05}), 0.001),
    "gru-copy-sgd": (_recipe({"name": "rnn", "cell": "gru", "hidden": 32},
                             {"name": "sequence", "task": "copy", "seq_len": 16, "dim": 4},
                             {"name": "sgd", "lr": 8.0, "momentum": 0.9}, clipping=NO_CLIP), 0.5),
    "linear-adam-ill-conditioned": (_recipe({"name": "linear"}, {"name": "regression", "dim": 32, "condition": 100.0},
                                            {"name": "adam", "lr": 1.0}), 0.03),
    "mlp-tanh-sgd": (_recipe({"name": "deep_mlp", "depth": 6, "width": 64, "activation": "tanh"},
                             {"name": "regression", "dim": 16}, {"name": "sgd", "lr": 1.5}, clipping=NO_CLIP), 0.005),
}
FAULTS_OFF = -1.0
"""A reference LR of this value: the reference is the same recipe without its faults (an injected fault's case)."""
SCENARIOS_2026_12_05: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-05 after that day's earlier rules; mlp-gelu-sgd-momentum then led to the trivial-loss
    # verdict (so it is no longer fresh), the others were not used for any rule (BENCHMARKS.md)
    "gpt-4layer-adam-warmup5": (_recipe(_gpt(64, n_layers=4), MARKOV, {"name": "adam", "lr": 0.02}, warmup=5),
                                0.002),
    "lstm-sum-adam": (_recipe({"name": "rnn", "cell": "lstm", "hidden": 64},
                              {"name": "sequence", "task": "running_sum", "seq_len": 16, "dim": 8},
                              {"name": "adam", "lr": 0.3}), 0.01),
    "mlp-gelu-sgd-momentum": (_recipe({"name": "deep_mlp", "depth": 8, "width": 64, "activation": "gelu",
                                       "init_scale": 2.0}, {"name": "regression", "dim": 16},
                                      {"name": "sgd", "lr": 0.1, "momentum": 0.9}, clipping=NO_CLIP), 0.01),
    "linear-sgd-cond1000": (_recipe({"name": "linear"}, {"name": "regression", "dim": 64, "condition": 1000.0},
                                    {"name": "sgd", "lr": 0.5}, clipping=NO_CLIP), 0.025),
    "gpt-adamw-grad-fault": ({**_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.003}, warmup=10),
                              "faults": [{"type": "grad_scale", "step": 70, "factor": 1e4}]}, FAULTS_OFF),
    "gpt-fp16-adamw-lr0.02": (_recipe(_gpt(64), MARKOV, {"name": "adamw", "lr": 0.02}, dtype="fp16"), 0.002),
    # healthy controls: the reference is the run itself; ballast should leave them alone (1 attempt)
    "control-mlp-relu-adam": (_recipe({"name": "deep_mlp", "depth": 6, "width": 64}, {"name": "regression", "dim": 16},
                                      {"name": "adam", "lr": 0.001}), 0.001),
    "control-gru-sum-sgd": (_recipe({"name": "rnn", "cell": "gru", "hidden": 32},
                                    {"name": "sequence", "task": "running_sum", "seq_len": 16, "dim": 4},
                                    {"name": "sgd", "lr": 0.05, "momentum": 0.9}), 0.05),
    "control-gpt-bf16-d32": (_recipe(_gpt(32), MARKOV, {"name": "adamw", "lr": 0.002}, warmup=15, dtype="bf16"),
                             0.002),
}
SCENARIOS_2026_12_06: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-06 before running any of them, from families neither half nor the earlier sets hold
    "gpt-adam-low-beta2": (_recipe(_gpt(64), MARKOV, {"name": "adam", "lr": 0.01, "betas": [0.9, 0.5]}), 0.001),
    "mlp-adamw-heavy-decay": (_recipe({"name": "deep_mlp", "depth": 4, "width": 64}, {"name": "regression", "dim": 16},
                                      {"name": "adamw", "lr": 0.05, "weight_decay": 5.0}), 0.002),
    "rnn-radius1.5-adam": (_recipe({"name": "rnn", "cell": "rnn", "hidden": 64, "recurrent_spectral_radius": 1.5},
                                   {"name": "sequence", "task": "running_sum", "seq_len": 24, "dim": 4},
                                   {"name": "adam", "lr": 0.03}, clipping=NO_CLIP), 0.001),
    "gpt-nan-at-step-3": ({**_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.003}, warmup=10),
                           "faults": [{"type": "nan_loss", "step": 3}]}, FAULTS_OFF),
    "lstm-poisoned-batch-late": ({**_recipe({"name": "rnn", "cell": "lstm", "hidden": 32},
                                            {"name": "sequence", "task": "running_sum", "seq_len": 16, "dim": 4},
                                            {"name": "adam", "lr": 0.01}, clipping=NO_CLIP),
                                  "faults": [{"type": "batch_scale", "step": 138, "factor": 1e3}]}, FAULTS_OFF),
    "gpt-postln-sgd-nesterov": (_recipe(_gpt(64, norm_position="post", n_layers=3), MARKOV,
                                        {"name": "sgd", "lr": 2.0, "momentum": 0.95, "nesterov": True},
                                        clipping=NO_CLIP), 0.2),
    # healthy controls: the reference is the run itself; ballast should leave them alone (1 attempt)
    "control-gpt-batch2": ({**_recipe(_gpt(32), MARKOV, {"name": "adamw", "lr": 0.001}, warmup=10),
                            "training": {"max_steps": 150, "batch_size": 2, "seed": 11}}, 0.001),
    "control-mlp-sigmoid-shallow": (_recipe({"name": "deep_mlp", "depth": 3, "width": 32, "activation": "sigmoid"},
                                            {"name": "regression", "dim": 8}, {"name": "adam", "lr": 0.003}), 0.003),
    "control-linear-adam-cond10": (_recipe({"name": "linear"}, {"name": "regression", "dim": 16, "condition": 10.0},
                                           {"name": "adam", "lr": 0.01}), 0.01),
}
SCENARIOS_2026_12_06B: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-06 (a second set that day) before running any of them: a peak reached late, a late
    # transient, a burst of faults, gated recurrences, heavy-ball momentum, bf16 SGD
    "gpt-late-warmup-peak": (_recipe(_gpt(64), MARKOV, {"name": "adamw", "lr": 0.05}, warmup=60), 0.003),
    "gpt-nan-late": ({**_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.003}, warmup=10),
                      "faults": [{"type": "nan_loss", "step": 110}]}, FAULTS_OFF),
    "mlp-grad-burst": ({**_recipe({"name": "deep_mlp", "depth": 4, "width": 64}, {"name": "regression", "dim": 16},
                                  {"name": "adam", "lr": 0.003}, clipping=NO_CLIP),
                        "faults": [{"type": "grad_scale", "step": s, "factor": 1e3} for s in (40, 41, 42)]},
                       FAULTS_OFF),
    "gru-copy-adam-high": (_recipe({"name": "rnn", "cell": "gru", "hidden": 32},
                                   {"name": "sequence", "task": "copy", "seq_len": 16, "dim": 4},
                                   {"name": "adam", "lr": 0.1}, clipping=NO_CLIP), 0.003),
    "linear-heavy-ball-cond100": (_recipe({"name": "linear"}, {"name": "regression", "dim": 32, "condition": 100.0},
                                          {"name": "sgd", "lr": 0.2, "momentum": 0.9}, clipping=NO_CLIP), 0.01),
    "gpt-bf16-sgd": (_recipe(_gpt(32), MARKOV, {"name": "sgd", "lr": 5.0}, clipping=NO_CLIP, dtype="bf16"), 0.5),
    # healthy controls: the reference is the run itself; ballast should leave them alone (1 attempt)
    "control-gpt-4layer-warmup": (_recipe(_gpt(64, n_layers=4), MARKOV, {"name": "adamw", "lr": 0.001}, warmup=20),
                                  0.001),
    "control-lstm-copy-adam": (_recipe({"name": "rnn", "cell": "lstm", "hidden": 32},
                                       {"name": "sequence", "task": "copy", "seq_len": 16, "dim": 4},
                                       {"name": "adam", "lr": 0.003}), 0.003),
    "control-mlp-tanh-sgd": (_recipe({"name": "deep_mlp", "depth": 4, "width": 64, "activation": "tanh"},
                                     {"name": "regression", "dim": 16}, {"name": "sgd", "lr": 0.05}), 0.05),
}
SCENARIOS_2026_12_06C: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-06 (a third set that day) before running any of them: a constant LR at the edge, fp16 at a
    # high LR behind a warmup, gradient accumulation, a NaN at the very first step, a poisoned batch in the warmup,
    # a deep un-normalised residual MLP
    "gpt-constant-lr-edge": ({**_recipe(_gpt(64), MARKOV, {"name": "adamw", "lr": 0.03}, warmup=10),
                              "schedule": {"warmup_steps": 10, "decay": "constant"}}, 0.003),
    "gpt-fp16-warmup-high": (_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.08}, warmup=15, dtype="fp16"),
                             0.003),
    "gpt-grad-accum-sgd": ({**_recipe(_gpt(32), MARKOV, {"name": "sgd", "lr": 4.0, "momentum": 0.9},
                                      clipping=NO_CLIP),
                            "training": {"max_steps": 150, "batch_size": 4, "grad_accum_steps": 4, "seed": 5}}, 0.4),
    "lstm-nan-at-step-0": ({**_recipe({"name": "rnn", "cell": "lstm", "hidden": 32},
                                      {"name": "sequence", "task": "running_sum", "seq_len": 16, "dim": 4},
                                      {"name": "adam", "lr": 0.01}),
                            "faults": [{"type": "nan_loss", "step": 0}]}, FAULTS_OFF),
    "mlp-poisoned-in-warmup": ({**_recipe({"name": "deep_mlp", "depth": 4, "width": 64},
                                          {"name": "regression", "dim": 16}, {"name": "adam", "lr": 0.003}, warmup=20),
                                "faults": [{"type": "batch_scale", "step": 6, "factor": 1e5}]}, FAULTS_OFF),
    "mlp-residual-relu-adam": (_recipe({"name": "deep_mlp", "depth": 12, "width": 64, "activation": "relu",
                                        "residual": True}, {"name": "regression", "dim": 16},
                                       {"name": "adam", "lr": 0.03}, clipping=NO_CLIP), 0.001),
    # healthy controls: the reference is the run itself; ballast should leave them alone (1 attempt)
    "control-gpt-300-steps": ({**_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.002}, warmup=20),
                               "training": {"max_steps": 300, "batch_size": 16, "seed": 9}}, 0.002),
    "control-rnn-copy-clip": (_recipe({"name": "rnn", "cell": "rnn", "hidden": 32},
                                      {"name": "sequence", "task": "copy", "seq_len": 12, "dim": 4},
                                      {"name": "sgd", "lr": 0.05, "momentum": 0.9}), 0.05),
    "control-linear-sgd-cond10": (_recipe({"name": "linear"}, {"name": "regression", "dim": 16, "condition": 10.0},
                                          {"name": "sgd", "lr": 0.05}), 0.05),
}
SCENARIOS_2026_12_06D: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-06 (a fourth set that day) before running any of them: a deep narrow transformer, wider
    # attention at a long context, two separate spikes, a poisoned batch at the very end, a two-layer GRU under
    # heavy SGD, Adam on a badly conditioned least-squares problem, a long run at a high LR, and a tiny Adam epsilon
    "gpt-8layer-adamw-no-warmup": (_recipe(_gpt(32, n_layers=8), MARKOV, {"name": "adamw", "lr": 0.02}), 0.002),
    "gpt-4head-context32-high": ({**_recipe({**_gpt(64, n_heads=4), "context": 32},
                                            {**MARKOV, "seq_len": 32}, {"name": "adamw", "lr": 0.04}, warmup=10)},
                                 0.003),
    "gpt-two-grad-spikes": ({**_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.003}, warmup=10,
                                       clipping=NO_CLIP),
                             "faults": [{"type": "grad_scale", "step": 40, "factor": 1e3},
                                        {"type": "grad_scale", "step": 100, "factor": 1e3}]}, FAULTS_OFF),
    "mlp-poisoned-at-the-end": ({**_recipe({"name": "deep_mlp", "depth": 4, "width": 64},
                                           {"name": "regression", "dim": 16}, {"name": "adam", "lr": 0.003}),
                                 "faults": [{"type": "batch_scale", "step": 146, "factor": 1e4}]}, FAULTS_OFF),
    "gru-2layer-sgd-high": (_recipe({"name": "rnn", "cell": "gru", "hidden": 32, "layers": 2},
                                    {"name": "sequence", "task": "running_sum", "seq_len": 16, "dim": 4},
                                    {"name": "sgd", "lr": 4.0, "momentum": 0.9}, clipping=NO_CLIP), 0.1),
    "linear-adam-cond1e4": (_recipe({"name": "linear"}, {"name": "regression", "dim": 32, "condition": 1e4},
                                    {"name": "adam", "lr": 0.5}), 0.01),
    "gpt-300-steps-adamw-high": ({**_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.05}),
                                  "training": {"max_steps": 300, "batch_size": 16, "seed": 13}}, 0.002),
    "gpt-adam-tiny-eps-high": (_recipe(_gpt(64), MARKOV, {"name": "adam", "lr": 0.02, "eps": 1e-12}, warmup=5),
                               0.002),
    # healthy controls: the reference is the run itself; ballast should leave them alone (1 attempt)
    "control-gpt-8layer-low": (_recipe(_gpt(32, n_layers=8), MARKOV, {"name": "adamw", "lr": 0.001}, warmup=15),
                               0.001),
    "control-gru-2layer-adam": (_recipe({"name": "rnn", "cell": "gru", "hidden": 32, "layers": 2},
                                        {"name": "sequence", "task": "running_sum", "seq_len": 16, "dim": 4},
                                        {"name": "adam", "lr": 0.003}), 0.003),
    "control-mlp-gelu-adamw-decay": (_recipe({"name": "deep_mlp", "depth": 6, "width": 64, "activation": "gelu"},
                                             {"name": "regression", "dim": 16},
                                             {"name": "adamw", "lr": 0.001, "weight_decay": 0.1}), 0.001),
}
SCENARIOS_2026_12_06E: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-06 (a fifth set that day) after the collapse rule, which the sixth set (above) led to, and
    # before running any of them: held out from that rule. More high-LR transformers of other shapes (the rule's
    # family), with QK layer norm and a z-loss (the usual cures), a small batch, a gated recurrence and a deep MLP
    # at high LRs, and a two-step NaN burst
    "gpt-d96-adam-no-warmup": (_recipe(_gpt(96), MARKOV, {"name": "adam", "lr": 0.03}), 0.002),
    "gpt-3layer-adamw-warmup10-high": (_recipe(_gpt(48, n_layers=3), MARKOV, {"name": "adamw", "lr": 0.08},
                                               warmup=10), 0.003),
    "gpt-qk-layernorm-high": (_recipe(_gpt(64, qk_layernorm=True), MARKOV, {"name": "adamw", "lr": 0.05}), 0.002),
    "gpt-batch4-adamw": ({**_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.02}),
                          "training": {"max_steps": 150, "batch_size": 4, "seed": 17}}, 0.002),
    "lstm-copy-adam-high": (_recipe({"name": "rnn", "cell": "lstm", "hidden": 32},
                                    {"name": "sequence", "task": "copy", "seq_len": 16, "dim": 4},
                                    {"name": "adam", "lr": 0.05}, clipping=NO_CLIP), 0.003),
    "mlp-relu-sgd-nesterov-high": (_recipe({"name": "deep_mlp", "depth": 6, "width": 64},
                                           {"name": "regression", "dim": 16},
                                           {"name": "sgd", "lr": 0.5, "momentum": 0.9, "nesterov": True},
                                           clipping=NO_CLIP), 0.01),
    "gpt-nan-burst": ({**_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.003}, warmup=10),
                       "faults": [{"type": "nan_loss", "step": 50}, {"type": "nan_loss", "step": 51}]}, FAULTS_OFF),
    "gpt-z-loss-adamw-high": (_recipe(_gpt(64, z_loss=1e-4), MARKOV, {"name": "adamw", "lr": 0.04}, warmup=5),
                              0.002),
    # healthy controls: the reference is the run itself; ballast should leave them alone (1 attempt)
    "control-gpt-d96-adam": (_recipe(_gpt(96), MARKOV, {"name": "adam", "lr": 0.001}, warmup=10), 0.001),
    "control-lstm-copy-adam-low": (_recipe({"name": "rnn", "cell": "lstm", "hidden": 32},
                                           {"name": "sequence", "task": "copy", "seq_len": 16, "dim": 4},
                                           {"name": "adam", "lr": 0.001}), 0.001),
    "control-gpt-qk-layernorm": (_recipe(_gpt(64, qk_layernorm=True), MARKOV, {"name": "adamw", "lr": 0.002},
                                         warmup=10), 0.002),
}
SCENARIOS_2026_12_06F: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-06 (the sixth set that day) after the upward probe candidate for a run that never learned,
    # which the seventh set's control-lstm-copy-adam-low led to, and before running any of them: held out from it,
    # but not from the extension's bound, which its gpt-adamw-lr1e-5 led to (the ninth set, below, is).
    # Two too-low LRs (the rule's family), a large weight decay, momentum 0.99, a wide MLP, bf16 at a high LR, a
    # late gradient spike and an RNN past the edge of chaos under Adam
    "gru-sum-sgd-low": (_recipe({"name": "rnn", "cell": "gru", "hidden": 32},
                                {"name": "sequence", "task": "running_sum", "seq_len": 16, "dim": 4},
                                {"name": "sgd", "lr": 0.001, "momentum": 0.9}), 0.05),
    "gpt-adamw-lr1e-5": (_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 1e-5}), 0.002),
    "gpt-adamw-high-weight-decay": (_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.01, "weight_decay": 1.0}),
                                    0.002),
    "gpt-sgd-momentum-0.99": (_recipe(_gpt(32), MARKOV, {"name": "sgd", "lr": 1.0, "momentum": 0.99},
                                      clipping=NO_CLIP), 0.1),
    "mlp-width256-adam-high": (_recipe({"name": "deep_mlp", "depth": 4, "width": 256},
                                       {"name": "regression", "dim": 16}, {"name": "adam", "lr": 0.03}), 0.001),
    "gpt-bf16-adam-warmup15-high": (_recipe(_gpt(64), MARKOV, {"name": "adam", "lr": 0.05}, warmup=15, dtype="bf16"),
                                    0.002),
    "gpt-late-grad-spike": ({**_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.003}, warmup=10),
                             "faults": [{"type": "grad_scale", "step": 120, "factor": 10000.0}]}, FAULTS_OFF),
    "rnn-radius-1.3-adam": (_recipe({"name": "rnn", "cell": "rnn", "hidden": 32, "recurrent_spectral_radius": 1.3},
                                    {"name": "sequence", "task": "running_sum", "seq_len": 16, "dim": 4},
                                    {"name": "adam", "lr": 0.02}, clipping=NO_CLIP), 0.002),
    # healthy controls: the reference is the run itself; ballast should leave them alone (1 attempt)
    "control-gru-sum-adam": (_recipe({"name": "rnn", "cell": "gru", "hidden": 32},
                                     {"name": "sequence", "task": "running_sum", "seq_len": 16, "dim": 4},
                                     {"name": "adam", "lr": 0.003}), 0.003),
    "control-mlp-width256-adam": (_recipe({"name": "deep_mlp", "depth": 4, "width": 256},
                                          {"name": "regression", "dim": 16}, {"name": "adam", "lr": 0.001}), 0.001),
    "control-gpt-bf16-adamw": (_recipe(_gpt(64), MARKOV, {"name": "adamw", "lr": 0.002}, warmup=10, dtype="bf16"),
                               0.002),
}
SCENARIOS_2026_12_06G: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-06 after the upward probe's extension bound (twice the candidates), which the eighth set's
    # gpt-adamw-lr1e-5 led to, and before running any of them: held out from both. Too-low LRs on other models and
    # optimizers (the rule's family), a post-LN transformer, an unclipped deep ReLU MLP under momentum SGD, a late
    # NaN, and their controls
    "linear-sgd-low": (_recipe({"name": "linear"}, {"name": "regression", "dim": 32, "condition": 10.0},
                               {"name": "sgd", "lr": 1e-4, "momentum": 0.0}), 0.01),
    "gpt-4layer-adam-lr3e-5": (_recipe(_gpt(64, n_layers=4), MARKOV, {"name": "adam", "lr": 3e-5}, warmup=10),
                               0.002),
    "mlp-tanh-adam-low": (_recipe({"name": "deep_mlp", "depth": 6, "width": 64, "activation": "tanh"},
                                  {"name": "regression", "dim": 16}, {"name": "adam", "lr": 2e-5}), 0.001),
    "gru-copy-adam-low": (_recipe({"name": "rnn", "cell": "gru", "hidden": 32},
                                  {"name": "sequence", "task": "copy", "seq_len": 16, "dim": 4},
                                  {"name": "adam", "lr": 1e-4}), 0.01),
    "gpt-sgd-low": (_recipe(_gpt(48), MARKOV, {"name": "sgd", "lr": 0.01, "momentum": 0.9}), 0.3),
    "gpt-postln-adamw-warmup5-high": (_recipe(_gpt(48, norm_position="post"), MARKOV, {"name": "adamw", "lr": 0.02},
                                              warmup=5), 0.002),
    "mlp-relu-noresid-sgd-high": (_recipe({"name": "deep_mlp", "depth": 8, "width": 64, "residual": False},
                                          {"name": "regression", "dim": 16},
                                          {"name": "sgd", "lr": 0.3, "momentum": 0.9}, clipping=NO_CLIP), 0.01),
    "lstm-sum-nan-step80": ({**_recipe({"name": "rnn", "cell": "lstm", "hidden": 32},
                                       {"name": "sequence", "task": "running_sum", "seq_len": 16, "dim": 4},
                                       {"name": "adam", "lr": 0.003}),
                             "faults": [{"type": "nan_loss", "step": 80}]}, FAULTS_OFF),
    # healthy controls: the reference is the run itself; ballast should leave them alone (1 attempt)
    "control-linear-sgd": (_recipe({"name": "linear"}, {"name": "regression", "dim": 32, "condition": 10.0},
                                   {"name": "sgd", "lr": 0.01, "momentum": 0.0}), 0.01),
    "control-gpt-4layer-adam": (_recipe(_gpt(64, n_layers=4), MARKOV, {"name": "adam", "lr": 0.002}, warmup=10),
                                0.002),
    "control-mlp-tanh-adam": (_recipe({"name": "deep_mlp", "depth": 6, "width": 64, "activation": "tanh"},
                                      {"name": "regression", "dim": 16}, {"name": "adam", "lr": 0.001}), 0.001),
}


def _gd(data: dict[str, Any], times_limit: float) -> tuple[dict[str, Any], float]:
    """Full-batch GD (no momentum, no clip, constant LR) on a fixed-design least-squares problem at ``times_limit``
    x its stability limit 2 / lambda_max (computed from the design), and the reference at half the limit."""
    spec = {"name": "regression", "fixed_design": True, **data}
    recipe = Recipe.model_validate({"name": "gd", "model": {"name": "linear"}, "data": spec,
                                    "training": {"batch_size": spec["num_samples"]}})
    source = build_data(recipe.data, seed=0, batch_size=spec["num_samples"])
    assert isinstance(source, RegressionSource) and source.hessian_lambda_max is not None
    limit = 2.0 / source.hessian_lambda_max
    doc = _recipe({"name": "linear"}, spec, {"name": "sgd", "lr": times_limit * limit, "momentum": 0.0},
                  clipping=NO_CLIP)
    doc["training"]["batch_size"] = spec["num_samples"]
    doc["schedule"]["decay"] = "constant"
    return doc, 0.5 * limit


SCENARIOS_2026_12_07: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-07 after the probe's refinement above the cut and its early end of the descent, and before
    # running any of them: held out from both. Early blow-ups (within a probe's span of the start) on other problems,
    # models and optimizers, where the cut may or may not score best, and their controls
    "gd-lsq-1.6x-limit": _gd({"dim": 24, "condition": 30.0, "noise": 0.1, "seed": 11, "num_samples": 96}, 1.6),
    "gd-lsq-1.05x-limit": _gd({"dim": 8, "condition": 5.0, "noise": 0.2, "seed": 5, "num_samples": 48}, 1.05),
    "gd-lsq-3x-limit": _gd({"dim": 32, "condition": 100.0, "noise": 0.05, "seed": 2, "num_samples": 128}, 3.0),
    "mlp-gelu-adam-high": (_recipe({"name": "deep_mlp", "depth": 6, "width": 96, "activation": "gelu"},
                                   {"name": "regression", "dim": 24}, {"name": "adam", "lr": 0.05}), 0.001),
    "gpt-1layer-sgd-nesterov-high": (_recipe(_gpt(32, n_layers=1), MARKOV,
                                             {"name": "sgd", "lr": 5.0, "momentum": 0.9, "nesterov": True},
                                             clipping=NO_CLIP), 0.3),
    "lstm-sum-sgd-high": (_recipe({"name": "rnn", "cell": "lstm", "hidden": 48},
                                  {"name": "sequence", "task": "running_sum", "seq_len": 24, "dim": 4},
                                  {"name": "sgd", "lr": 20.0, "momentum": 0.0}, clipping=NO_CLIP), 1.0),
    "gpt-adamw-wd-high-no-warmup": (_recipe(_gpt(96), MARKOV, {"name": "adamw", "lr": 0.04, "weight_decay": 0.1}),
                                    0.002),
    # healthy controls
    "control-gd-lsq-half-limit": _gd({"dim": 24, "condition": 30.0, "noise": 0.1, "seed": 11, "num_samples": 96},
                                     0.5),
    "control-mlp-gelu-adam": (_recipe({"name": "deep_mlp", "depth": 6, "width": 96, "activation": "gelu"},
                                      {"name": "regression", "dim": 24}, {"name": "adam", "lr": 0.001}), 0.001),
    "control-lstm-sum-sgd": (_recipe({"name": "rnn", "cell": "lstm", "hidden": 48},
                                     {"name": "sequence", "task": "running_sum", "seq_len": 24, "dim": 4},
                                     {"name": "sgd", "lr": 1.0, "momentum": 0.0}, clipping=NO_CLIP), 1.0),
}
SCENARIOS_2026_12_07B: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-07 (a second set that day), after the lineage's stall clock, and before running any of
    # them: warmups to a peak LR too high to train at but not so high that the loss spikes (the family of the
    # benchmark's warmup plateaus: the loss falls during the warmup, then sits or creeps), on transformers of other
    # widths, depths, heads, contexts, optimizers and run lengths; a development set for that family
    "gpt-d48-warmup25-peak0.1": (_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.1}, warmup=25), 0.003),
    "gpt-3layer-warmup40-peak0.06": (_recipe(_gpt(64, n_layers=3), MARKOV, {"name": "adamw", "lr": 0.06},
                                             warmup=40), 0.003),
    "gpt-d128-adam-warmup30-peak0.05": (_recipe(_gpt(128), MARKOV, {"name": "adam", "lr": 0.05}, warmup=30),
                                        0.003),
    "gpt-4head-wd-warmup50-peak0.12": (_recipe(_gpt(64, n_heads=4), MARKOV,
                                               {"name": "adamw", "lr": 0.12, "weight_decay": 0.1}, warmup=50), 0.003),
    "gpt-d32-warmup20-peak0.3": (_recipe(_gpt(32), MARKOV, {"name": "adamw", "lr": 0.3}, warmup=20), 0.003),
    "gpt-context32-warmup30-peak0.04": (_recipe({**_gpt(96), "context": 32}, {**MARKOV, "seq_len": 32},
                                                {"name": "adamw", "lr": 0.04}, warmup=30), 0.003),
    "gpt-qk-layernorm-warmup30-peak0.15": (_recipe(_gpt(64, qk_layernorm=True), MARKOV,
                                                   {"name": "adamw", "lr": 0.15}, warmup=30), 0.003),
    "gpt-d80-warmup60-peak0.07-200": ({**_recipe(_gpt(80), MARKOV, {"name": "adamw", "lr": 0.07}, warmup=60),
                                       "training": {"max_steps": 200, "batch_size": 16, "seed": 23}}, 0.003),
    # healthy controls: the reference is the run itself; ballast should leave them alone (1 attempt)
    "control-gpt-d128-adam-warmup30": (_recipe(_gpt(128), MARKOV, {"name": "adam", "lr": 0.003}, warmup=30), 0.003),
    "control-gpt-d48-warmup25": (_recipe(_gpt(48), MARKOV, {"name": "adamw", "lr": 0.003}, warmup=25), 0.003),
}
USER = "benchmarks.divergence.user_code"
EXAMPLE = "examples.classifier.model"


def _own(model: str, params: dict[str, Any], data: str, data_params: dict[str, Any], loss: dict[str, Any],
         optimizer: dict[str, Any], *, warmup: int = 0) -> dict[str, Any]:
    """A recipe on your own code: a model and a dataset factory by import string (``user_code.py`` unless the
    name has a module), 32 samples per batch."""
    def ref(name: str) -> str:
        return name if ":" in name else f"{USER}:{name}"

    doc = _recipe({"name": "custom", "factory": ref(model), "params": params},
                  {"name": "dataset", "factory": ref(data), "params": data_params}, optimizer, warmup=warmup)
    doc["training"]["batch_size"] = 32
    doc["loss"] = loss
    return doc


CE, MSE = {"name": "cross_entropy"}, {"name": "mse"}
_MEMORISES = _own("mlp", {"out": 4, "hidden": 256, "depth": 4}, "imbalanced_classes", {"n": 256, "major": 0.5}, CE,
                  {"name": "adam", "lr": 0.003})
_MEMORISES["training"].update(max_steps=300, eval_interval=25)
_MEMORISES["data"]["eval_fraction"] = 0.25
SCENARIOS_2026_12_07C: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-07 (a third set that day) after the trivial loss of a user's dataset: your own models,
    # datasets and losses (user_code.py and the classifier example), which no earlier set had. The first was seen
    # while writing it (at AdamW 0.03 the classifier was stopped as diverging at a loss of 0.007, which led to the
    # ratio rule's noise margin); the others were written before any of them ran
    "own-classifier-adamw-0.03": (_own(f"{EXAMPLE}:make_classifier",
                                       {"in_features": 16, "hidden": 64, "classes": 4, "depth": 3},
                                       f"{EXAMPLE}:make_dataset", {"n": 2048, "in_features": 16, "classes": 4}, CE,
                                       {"name": "adamw", "lr": 0.03}), 0.001),
    "own-residual-mlp-offset-adamw-high": (_own("residual_mlp", {}, "offset_regression", {}, MSE,
                                                {"name": "adamw", "lr": 0.05}), 0.001),
    "own-mlp-offset10-sgd-high": (_own("mlp", {}, "offset_regression", {"offset": 10.0}, MSE,
                                       {"name": "sgd", "lr": 0.05, "momentum": 0.0}), 0.002),
    "own-keyed-dict-adam-high": (_own("keyed_net", {}, "keyed", {}, CE, {"name": "adam", "lr": 0.3}), 0.003),
    "own-imbalanced-adam-high": (_own("mlp", {"out": 4}, "imbalanced_classes", {"major": 0.95}, CE,
                                      {"name": "adam", "lr": 0.05}), 0.001),
    "own-residual-mlp-imbalanced-sgd-momentum": (_own("residual_mlp", {"out": 4}, "imbalanced_classes", {}, CE,
                                                      {"name": "sgd", "lr": 1.0, "momentum": 0.9}, warmup=10),
                                                 0.05),
    "own-mlp-smoothed-ce-adamw-warmup-high": (_own("mlp", {"out": 4, "depth": 5}, "imbalanced_classes", {},
                                                   {"name": "cross_entropy", "label_smoothing": 0.1},
                                                   {"name": "adamw", "lr": 0.1}, warmup=20), 0.002),
    # seen while writing the set, like the first: a wide MLP memorises 192 samples while its held-out loss rises
    # (overfitting, not a divergence: no LR or clip retry fixes it)
    "own-mlp-memorises-eval": (_MEMORISES, 0.001),
    # nothing to learn: labels independent of the features; the right outcome is never_learned, not SUCCEEDED
    "own-unrelated-labels": (_own("mlp", {"in_features": 8, "out": 2}, "unrelated_labels", {}, CE,
                                  {"name": "adam", "lr": 0.001}), 0.0003),
    # healthy controls: the reference is the run itself; ballast should leave them alone (1 attempt)
    "control-own-residual-mlp-offset": (_own("residual_mlp", {}, "offset_regression", {}, MSE,
                                             {"name": "adamw", "lr": 0.001}), 0.001),
    "control-own-keyed-dict": (_own("keyed_net", {}, "keyed", {}, CE, {"name": "adam", "lr": 0.003}), 0.003),
}


def _own_batches(model: str, params: dict[str, Any], factory: str, loss: dict[str, Any], optimizer: dict[str, Any],
                 *, warmup: int = 0) -> dict[str, Any]:
    """A recipe on your own model and a ``custom`` batch factory (``user_code.py``), 32 samples per batch."""
    doc = _own(model, params, "unused", {}, loss, optimizer, warmup=warmup)
    doc["data"] = {"name": "custom", "factory": f"{USER}:{factory}", "params": {}}
    return doc


def _with(doc: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    return deep_merge(doc, sections)


SCENARIOS_2026_12_07D: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-07 (a fourth set that day), after the trivial loss of data read batch by batch and of
    # large datasets: custom batch factories, a large dataset whose items are made when read, an LSTM on
    # sequences, a CNN on images, gradient accumulation, bf16. Every scenario and reference LR was written before
    # any of them ran
    "own-lstm-running-mean-adam-high": (_own_batches("seq_lstm", {}, "running_mean_batch", MSE,
                                                     {"name": "adam", "lr": 0.1}), 0.003),
    "own-mlp-smooth-batches-sgd-momentum-high": (_own_batches("mlp", {"in_features": 8}, "smooth_regression_batch",
                                                              MSE, {"name": "sgd", "lr": 0.5, "momentum": 0.9}),
                                                 0.01),
    "own-lazy-pairs-adamw-high": (_own("mlp", {"out": 5}, "lazy_pairs", {}, CE, {"name": "adamw", "lr": 0.1}),
                                  0.002),
    "own-cnn-blobs-adam-high": (_own("small_cnn", {}, "blob_images", {}, CE, {"name": "adam", "lr": 0.05}), 0.001),
    "own-residual-accum4-adamw-high": (_with(_own("residual_mlp", {}, "offset_regression", {}, MSE,
                                                  {"name": "adamw", "lr": 0.05}),
                                             training={"grad_accum_steps": 4, "batch_size": 8}), 0.001),
    "own-mlp-bf16-adam-high": (_with(_own("mlp", {"out": 4}, "imbalanced_classes", {}, CE,
                                          {"name": "adam", "lr": 0.05}), precision={"dtype": "bf16"}), 0.001),
    # nothing to learn, read batch by batch and from a large lazy dataset: never_learned, not SUCCEEDED
    "own-coin-batches": (_own_batches("mlp", {"in_features": 8, "out": 2}, "coin_batch", CE,
                                      {"name": "adam", "lr": 0.001}), 0.0003),
    "own-lazy-pairs-unrelated": (_own("mlp", {"out": 5}, "lazy_pairs", {"related": False}, CE,
                                      {"name": "adam", "lr": 0.001}), 0.0003),
    # healthy controls: the reference is the run itself; ballast should leave them alone (1 attempt)
    "control-own-lstm-running-mean": (_own_batches("seq_lstm", {}, "running_mean_batch", MSE,
                                                   {"name": "adam", "lr": 0.003}), 0.003),
    "control-own-cnn-blobs": (_own("small_cnn", {}, "blob_images", {}, CE, {"name": "adam", "lr": 0.001}), 0.001),
    "control-own-lazy-pairs": (_own("mlp", {"out": 5}, "lazy_pairs", {}, CE, {"name": "adamw", "lr": 0.002}),
                               0.002),
}
SCENARIOS_2026_12_07E: dict[str, tuple[dict[str, Any], float]] = {
    # written on 2026-12-07 (a fifth set that day) to exercise the recipe's other settings on your own code: fp16
    # with dynamic loss scaling, per-layer, adaptive and z-score clipping, Nesterov SGD, linear and constant
    # schedules, gradient accumulation in fp16, an eval series. Every scenario and reference LR was written
    # before any of them ran
    "own-cnn-fp16-adam-high": (_with(_own("small_cnn", {}, "blob_images", {}, CE, {"name": "adam", "lr": 0.05}),
                                     precision={"dtype": "fp16"}), 0.001),
    "own-lstm-per-layer-clip-sgd-high": (_with(_own_batches("seq_lstm", {}, "running_mean_batch", MSE,
                                                            {"name": "sgd", "lr": 2.0, "momentum": 0.9}),
                                               clipping={"method": "per_layer", "max_norm": 1.0}), 0.05),
    "own-residual-adaptive-clip-adamw-high": (_with(_own("residual_mlp", {}, "offset_regression", {}, MSE,
                                                         {"name": "adamw", "lr": 0.08}),
                                                    clipping={"method": "adaptive"}), 0.001),
    "own-lazy-pairs-nesterov-linear-high": (_with(_own("mlp", {"out": 5}, "lazy_pairs", {}, CE,
                                                       {"name": "sgd", "lr": 3.0, "momentum": 0.9, "nesterov": True}),
                                                  schedule={"decay": "linear"}), 0.05),
    "own-keyed-dict-zscore-clip-adam-high": (_with(_own("keyed_net", {}, "keyed", {}, CE,
                                                        {"name": "adam", "lr": 0.2}),
                                                   clipping={"method": "zscore"}), 0.003),
    "own-mlp-accum8-fp16-adamw-high": (_with(_own("mlp", {"out": 4}, "imbalanced_classes", {}, CE,
                                                  {"name": "adamw", "lr": 0.08}),
                                             training={"grad_accum_steps": 8, "batch_size": 4},
                                             precision={"dtype": "fp16"}), 0.001),
    "own-cnn-eval-adam-high": (_with(_own("small_cnn", {}, "blob_images", {}, CE, {"name": "adam", "lr": 0.03}),
                                     training={"eval_interval": 25}, data={"eval_fraction": 0.2}), 0.001),
    "own-lstm-constant-lr-adam-high": (_with(_own_batches("seq_lstm", {}, "running_mean_batch", MSE,
                                                          {"name": "adam", "lr": 0.03}, warmup=10),
                                             schedule={"decay": "constant"}), 0.003),
    # healthy controls: the reference is the run itself; ballast should leave them alone (1 attempt)
    "control-own-cnn-fp16": (_with(_own("small_cnn", {}, "blob_images", {}, CE, {"name": "adam", "lr": 0.001}),
                                   precision={"dtype": "fp16"}), 0.001),
    "control-own-residual-adaptive-clip": (_with(_own("residual_mlp", {}, "offset_regression", {}, MSE,
                                                      {"name": "adamw", "lr": 0.001}),
                                                 clipping={"method": "adaptive"}), 0.001),
    "control-own-keyed-zscore-clip": (_with(_own("keyed_net", {}, "keyed", {}, CE, {"name": "adam", "lr": 0.003}),
                                            clipping={"method": "zscore"}), 0.003),
}
POLICIES = {"none": {"max_retries": 0}, "ballast": {}}


def run(doc: dict[str, Any], recovery: dict[str, Any]) -> dict[str, Any]:
    """One run through the local recovery loop: its outcome, attempts, final loss and steps executed."""
    admitted = named_modules(doc)  # the scenario's own code (user_code.py, the examples)
    recipe = Recipe.model_validate({**copy.deepcopy(doc), "recovery": recovery},
                                   context={"allowed_import_modules": admitted})
    sinks: list[ListSink] = []  # one per attempt, in order

    def make_sink(spec: AttemptSpec, start: int) -> ListSink:
        sinks.append(ListSink())
        return sinks[-1]

    with tempfile.TemporaryDirectory() as root:
        out = LocalRun(recipe, Path(root), run_in_process, make_sink=make_sink, allowed_import_modules=admitted).run()
    # the metric events as the REST series the benchmark measures (a non-finite loss is absent, as there), so
    # both measure with one definition
    data: dict[str, Any] = {"series": {name: {"attempts": [], "steps": [], "values": []}
                                       for name in ("loss", "lr", "skipped")},
                            "attempts": [{"plan": {"lr_probe": a.lr_probe}} for a in out.attempts]}
    for attempt, sink in enumerate(sinks, start=1):
        for m in sink.of_type("metric"):
            for name, col in data["series"].items():
                value = (1.0 if m.get("skipped") else None) if name == "skipped" else m[name]
                if value is not None:
                    col["attempts"].append(attempt)
                    col["steps"].append(m["step"])
                    col["values"].append(value)
    n = recipe.training.max_steps
    final, complete = final_loss(data, n)
    return {
        "outcome": out.outcome,
        "final": final if complete else None,
        "steps": round(steps_executed(data) / n, 2),
        "attempts": [{"outcome": a.outcome, "changes": {k: v[1] for k, v in a.overrides.items()}}
                     for a in out.attempts],
        "reason": out.last.reason or out.gave_up or "",
    }


SETS: dict[str, dict[str, tuple[dict[str, Any], float]]] = {
    "first": SCENARIOS, "2026-12-05": SCENARIOS_2026_12_05, "2026-12-06": SCENARIOS_2026_12_06,
    "2026-12-06b": SCENARIOS_2026_12_06B, "2026-12-06c": SCENARIOS_2026_12_06C, "2026-12-06d": SCENARIOS_2026_12_06D,
    "2026-12-06e": SCENARIOS_2026_12_06E, "2026-12-06f": SCENARIOS_2026_12_06F, "2026-12-06g": SCENARIOS_2026_12_06G,
    "2026-12-07": SCENARIOS_2026_12_07, "2026-12-07b": SCENARIOS_2026_12_07B, "2026-12-07c": SCENARIOS_2026_12_07C,
    "2026-12-07d": SCENARIOS_2026_12_07D, "2026-12-07e": SCENARIOS_2026_12_07E,
}
"""Every set by name (``--set NAME``); the first (``SCENARIOS``) also runs when no name is given."""


def reference_doc(doc: dict[str, Any], ref_lr: float) -> dict[str, Any]:
    """A scenario's reference: the same recipe at its safe LR, or without its faults."""
    return deep_merge(doc, {"faults": []} if ref_lr == FAULTS_OFF else {"optimizer": {"lr": ref_lr}})


def main(names: list[str]) -> None:
    torch.set_num_threads(1)
    every = {name: entry for scenarios in SETS.values() for name, entry in scenarios.items()}
    if names[:1] == ["--set"]:
        names = list(SETS[names[1]]) + names[2:]
    for name in names or list(SCENARIOS):
        doc, ref_lr = every[name]
        ref = run(reference_doc(doc, ref_lr), POLICIES["none"])
        line: dict[str, Any] = {"scenario": name, "reference": {k: ref[k] for k in ("outcome", "final")}}
        for policy, recovery in POLICIES.items():
            res = run(doc, recovery)
            ok = res["final"] is not None and ref["final"]
            res["final_ratio"] = round(res["final"] / ref["final"], 3) if ok else None
            line[policy] = res
        print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
