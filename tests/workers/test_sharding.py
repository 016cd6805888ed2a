"""FSDP (``distributed.strategy: fsdp``): the recipe's refusals, sharded checkpoints (manifest, verification,
retention, export) at world size 1, and the 2-rank gloo acceptance run: FSDP trains, diverges under an injected
fault, rolls back in place and finishes; its world-size-2 checkpoint resumes at world size 1 bit-identically.

What "bit-identically" means across world sizes: a world-size-1 run cannot replay a world-size-2 run's losses
(each step sees a different number of batches, and sums in a different order), so the test pins down what can be
exact: (1) the weights (and optimizer state) a world-size-1 process loads from the 2-rank shards equal the weights
the shards hold, read independently of any model (``full_parts``: DCP's ``dcp_to_torch_save``); (2) the
world-size-1 resume of the sharded checkpoint produces exactly the losses and grad norms of a world-size-1 resume
of the equivalent full (``strategy: ddp``) checkpoint; (3) at the same world size, 10 steps + resume + 10 steps
equals 20 straight.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from ballast.export import export_checkpoint
from contracts.checkpoint import CorruptCheckpoint, apply_retention, list_checkpoints, verify_checkpoint
from contracts.recipe import Recipe, RecipeError, validate_recipe_data
from contracts.wire import AttemptSpec
from workers.checkpoint import load_checkpoint
from workers.context import WorkerContext
from workers.entry import run_attempt
from workers.sharded_checkpoint import SHARDS, full_parts, shards_of
from workers.trainer import GuardedTrainer

SCRIPT = Path(__file__).with_name("fsdp_script.py")


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fsdp_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def recipe(strategy: str = "fsdp", **changes: Any) -> Recipe:
    """The script's recipe (tiny_gpt, 20 steps, checkpoints at 10 and 20) at world size 1."""
    data = _script().recipe(strategy).model_dump(mode="json", by_alias=True)
    data["resources"]["num_workers"] = 1
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    return Recipe.model_validate(data)


# ------------------------------------------------------------------------------------------- the recipe
@pytest.mark.parametrize(("distributed", "precision", "field"), [
    ({"compression": "powersgd"}, {}, "distributed.compression"),
    ({"compression": "fp16"}, {}, "distributed.compression"),
    ({"lora": {"target_modules": ["qkv"]}}, {}, "distributed.lora"),
    ({}, {"dtype": "fp16"}, "precision.dtype"),
])
def test_fsdp_refuses_what_it_cannot_combine_with_naming_the_field(
        distributed: dict[str, Any], precision: dict[str, Any], field: str) -> None:
    data = recipe().model_dump(mode="json", by_alias=True)
    data["distributed"] |= distributed
    data["precision"] |= precision
    with pytest.raises(RecipeError) as info:
        validate_recipe_data(data)
    assert field in str(info.value) and "fsdp" in str(info.value)


def test_strategy_defaults_to_ddp_and_fsdp_validates() -> None:
    assert recipe("ddp").distributed.strategy.value == "ddp"
    assert recipe().distributed.strategy.value == "fsdp"
    data = recipe().model_dump(mode="json", by_alias=True)
    data["distributed"]["strategy"] = "zero3"
    with pytest.raises(RecipeError, match="distributed.strategy"):
        validate_recipe_data(data)


# ------------------------------------------------------------------------- sharded checkpoints, 1 rank
def test_a_sharded_checkpoint_is_verified_retained_exported_and_resumes_exactly(tmp_path: Path) -> None:
    """World size 1 (no process group): the checkpoint is sharded (DCP files under shards/, listed with their
    checksums in the manifest); it verifies, a damaged shard is refused, retention deletes it like any other,
    the export gets the full weights, and 10 + resume + 10 steps equal 20 straight."""
    r = recipe(checkpoint={"every_steps": 5, "keep": 10})
    straight = run_attempt(AttemptSpec(recipe=r, checkpoint_dir=str(tmp_path / "straight")))
    assert straight.outcome == "succeeded"
    ckpt = tmp_path / "straight" / "step_00000010"
    manifest = verify_checkpoint(ckpt)
    info = shards_of(manifest)
    assert info == {"dir": SHARDS, "parts": ["model", "optimizer"], "world_size": 1}
    shard_files = [n for n in manifest.files if n.startswith(f"{SHARDS}/")]
    assert f"{SHARDS}/.metadata" in shard_files and len(shard_files) == 2
    assert "model.pt" not in manifest.files and "optimizer.pt" not in manifest.files
    saved, _ = load_checkpoint(ckpt)
    assert "model" not in saved and {"scaler", "detectors", "rng", "progress"} <= set(saved)

    resumed = run_attempt(AttemptSpec(recipe=r, checkpoint_dir=str(tmp_path / "resumed"), resume_from=str(ckpt)))
    assert resumed.outcome == "succeeded" and resumed.start_step == 10
    assert resumed.losses == straight.losses[10:] and resumed.grad_norms == straight.grad_norms[10:]

    doc = export_checkpoint(ckpt, r, tmp_path / "export")
    exported = torch.load(tmp_path / "export" / "model.pt", weights_only=True)
    full = full_parts(ckpt, manifest)["model"]
    assert doc["checkpoint"]["step"] == 10 and exported.keys() == full.keys()
    assert all(torch.equal(exported[k], full[k]) for k in full)

    damaged = tmp_path / "straight" / "step_00000015"
    shard = damaged / SHARDS / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match="__0_0.distcp sha256 mismatch"):
        verify_checkpoint(damaged)
    with pytest.raises(CorruptCheckpoint, match="sha256 mismatch"):
        GuardedTrainer(AttemptSpec(recipe=r, checkpoint_dir=str(tmp_path / "x")), WorkerContext(),
                       resume_dir=damaged)

    deleted = apply_retention(tmp_path / "straight", keep=1, keep_healthy=False)
    assert len(deleted) == 3 and [m.step for _, m in list_checkpoints(tmp_path / "straight")] == [20]


# ------------------------------------------------------------------------------- 2 gloo ranks, then 1
@pytest.mark.timeout(420)
@pytest.mark.slow
def test_fsdp_on_two_gloo_ranks_recovers_in_place_and_resumes_at_world_size_one_bit_identically(
        tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), str(tmp_path)], capture_output=True,
                          text=True, timeout=400, cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads((tmp_path / f"results{rank}.json").read_text()) for rank in (0, 1)]

    # clipping on sharded parameters: the per-tensor norms, post-clip norm, clipped grads and update ratio of an
    # unsharded replica (global norm, per-layer and adaptive clipping; the norms from one all-reduce)
    for rank in (0, 1):
        for method, checks in out[rank]["clipping"].items():
            assert all(checks.values()), (rank, method, checks)

    # a frozen block (its FSDP unit has no gradients), activation checkpointing, adaptive clipping and bf16
    combined = out[0]["combined"]
    assert combined["outcome"] == "succeeded" and combined["losses"][-1] < combined["losses"][0]

    # trains, and resumes at the same world size exactly; every rank saw the same numbers
    straight, resumed = out[0]["straight"], out[0]["resumed"]
    assert straight["outcome"] == resumed["outcome"] == "succeeded" and len(straight["losses"]) == 20
    assert straight["losses"][-1] < straight["losses"][0]
    assert resumed["start_step"] == 10 and resumed["losses"] == straight["losses"][10:]
    assert resumed["grad_norms"] == straight["grad_norms"][10:]
    assert out[1]["straight"] == straight

    # diverges under the injected fault (NaN on rank 1 at step 12), rolls back in place to step 10 and finishes
    for rank in (0, 1):
        inplace = out[rank]["inplace"]
        assert inplace["previous"] == [["diverged", 12]]
        assert inplace["outcome"] == "succeeded" and inplace["attempt"] == 2 and inplace["start_step"] == 10
        assert inplace["final_step"] == 20
    assert [e["outcome"] for e in out[0]["inplace"]["ends"]] == ["diverged", "succeeded"]
    assert out[0]["inplace"]["layer_stats"] > 0  # per-layer stats from sharded gradients

    # the world-size-2 checkpoint at world size 1 (no process group)
    ckpt = tmp_path / "straight" / "step_00000010"
    manifest = verify_checkpoint(ckpt)
    assert shards_of(manifest) == {"dir": SHARDS, "parts": ["model", "optimizer"], "world_size": 2}
    assert {f"{SHARDS}/__0_0.distcp", f"{SHARDS}/__1_0.distcp", f"{SHARDS}/.metadata"} <= set(manifest.files)
    held = full_parts(ckpt, manifest, ["model", "optimizer"])

    # (1) the weights and optimizer state loaded at world size 1 are the ones the shards hold, exactly
    w1 = GuardedTrainer(AttemptSpec(recipe=recipe(), checkpoint_dir=str(tmp_path / "probe")), WorkerContext(),
                        resume_dir=ckpt)
    loaded = w1.module.state_dict()
    assert loaded.keys() == held["model"].keys()
    assert all(torch.equal(loaded[k], held["model"][k]) for k in loaded)
    names = [n for n, _ in w1.named_params]
    for i, p in enumerate(w1.params):
        for key, value in w1.optimizer.state[p].items():
            assert torch.equal(value, held["optimizer"]["state"][names[i]][key]), (names[i], key)

    # (2) the equivalent full checkpoint: the same state written by a world-size-1 strategy: ddp trainer
    full_dir = tmp_path / "full"
    as_ddp = GuardedTrainer(AttemptSpec(recipe=recipe("ddp"), checkpoint_dir=str(full_dir)), WorkerContext(),
                            resume_dir=ckpt)
    as_ddp.checkpoint(10)
    as_ddp.checkpointer.drain()  # the write is in the background: wait for it (the attempt's end would)
    assert shards_of(verify_checkpoint(full_dir / "step_00000010")) is None
    from_shards = run_attempt(AttemptSpec(recipe=recipe(), checkpoint_dir=str(tmp_path / "w1-sharded"),
                                          resume_from=str(ckpt)))
    from_full = run_attempt(AttemptSpec(recipe=recipe("ddp"), checkpoint_dir=str(tmp_path / "w1-full"),
                                        resume_from=str(full_dir / "step_00000010")))
    assert from_shards.outcome == from_full.outcome == "succeeded"
    assert from_shards.start_step == from_full.start_step == 10 and len(from_shards.losses) == 10
    assert from_shards.losses == from_full.losses and from_shards.grad_norms == from_full.grad_norms
    # and the world-size-1 run's own checkpoint is sharded again (at world size 1)
    assert shards_of(verify_checkpoint(tmp_path / "w1-sharded" / "step_00000020"))["world_size"] == 1  # type: ignore[index]
