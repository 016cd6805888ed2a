"""Checkpoints on an object store, without Ray: the same format, verification, listing, retention and fault code
as on disk, against a local S3-compatible server (moto). The bucket is read back with boto3, not with the code
under test."""

from __future__ import annotations

from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from contracts.checkpoint import (
    CorruptCheckpoint,
    apply_retention,
    find_checkpoints,
    read_manifest,
    verify_checkpoint,
)
from orchestrator.scheduler import verify_checkpoint as scheduler_verify
from orchestrator.scheduler.retention import remove_checkpoint_dirs
from orchestrator.settings import Settings
from tests.storage.s3 import Bucket
from workers.checkpoint import load_checkpoint, save_checkpoint
from workers.checkpointing import materialize
from workers.faults import corrupt_checkpoint_dir


def upload(bucket: Bucket, tmp_path: Path, steps: list[tuple[int, bool]], prefix: str = "run-1") -> dict[int, str]:
    """Write checkpoints on disk and copy each to ``<root>/<prefix>/step_XXXXXXXX`` (as Ray Train persists them)."""
    fs, root = bucket.storage.filesystem(f"{bucket.root}/{prefix}")
    uris: dict[int, str] = {}
    for step, healthy in steps:
        name = f"step_{step:08d}"
        info = save_checkpoint(tmp_path / name, {"model": {"w": torch.full((64,), float(step))}},
                               meta={"step": step, "healthy": healthy})
        fs.create_dir(f"{root}/{name}")
        pafs.copy_files(str(info.path), f"{root}/{name}", source_filesystem=pafs.LocalFileSystem(),
                        destination_filesystem=fs)
        uris[step] = f"{bucket.root}/{prefix}/{name}"
    return uris


def test_a_checkpoint_in_the_bucket_verifies_lists_and_loads(bucket: Bucket, tmp_path: Path) -> None:
    uris = upload(bucket, tmp_path, [(10, True), (20, False)])
    assert bucket.checkpoint_prefixes() == set(uris.values())
    local = read_manifest(tmp_path / "step_00000010")
    manifest = verify_checkpoint(uris[10], expected_sha256=local.sha256, storage=bucket.storage)
    assert (manifest.step, manifest.healthy, manifest.sha256) == (10, True, local.sha256)
    assert [(loc.uri, m.step) for loc, m in find_checkpoints(f"{bucket.root}/run-1", storage=bucket.storage)] == [
        (uris[10], 10), (uris[20], 20)]
    with materialize(uris[20], bucket.storage) as directory:  # a resume downloads it through Ray Train
        assert directory is not None and Path(directory).is_dir()
        state, m = load_checkpoint(directory)
        assert m.step == 20 and torch.equal(state["model"]["w"], torch.full((64,), 20.0))


def test_an_overwritten_object_fails_verification(bucket: Bucket, tmp_path: Path) -> None:
    uris = upload(bucket, tmp_path, [(10, True)])
    key = "ballast/run-1/step_00000010/model.pt"
    body = bytearray(bucket.client().get_object(Bucket=bucket.name, Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF  # same size, different bytes
    bucket.client().put_object(Bucket=bucket.name, Key=key, Body=bytes(body))
    with pytest.raises(CorruptCheckpoint, match="model.pt sha256 mismatch"):
        verify_checkpoint(uris[10], storage=bucket.storage)
    assert scheduler_verify(uris[10], None, storage=bucket.storage) == "model.pt sha256 mismatch (damaged contents)"
    bucket.client().delete_object(Bucket=bucket.name, Key=key)
    assert scheduler_verify(uris[10], None, storage=bucket.storage) == "model.pt is missing"
    assert scheduler_verify(f"{bucket.root}/run-1/step_00000099", None, storage=bucket.storage) == (
        "no such checkpoint directory")


def test_the_corrupt_checkpoint_fault_damages_the_object(bucket: Bucket, tmp_path: Path) -> None:
    uris = upload(bucket, tmp_path, [(10, True)])
    from contracts.storage import Location

    damaged = corrupt_checkpoint_dir(Location(uris[10], bucket.storage))
    assert damaged == f"{uris[10]}/model.pt"
    with pytest.raises(CorruptCheckpoint, match="sha256 mismatch"):
        verify_checkpoint(uris[10], storage=bucket.storage)


def test_retention_prunes_prefixes_in_the_bucket(bucket: Bucket, tmp_path: Path) -> None:
    uris = upload(bucket, tmp_path, [(10, True), (20, True), (30, False), (40, False), (50, False)])
    deleted = apply_retention(f"{bucket.root}/run-1", keep=2, keep_healthy=True, storage=bucket.storage)
    assert sorted(d.uri for d in deleted) == [uris[10], uris[30]]
    assert bucket.checkpoint_prefixes() == {uris[20], uris[40], uris[50]}
    # the scheduler's removal: only under the checkpoint root, through the configured endpoint
    remove_checkpoint_dirs([uris[20], "s3://elsewhere/x/step_00000001"], bucket.root, bucket.storage)
    assert bucket.checkpoint_prefixes() == {uris[40], uris[50]}


def test_the_background_writer_puts_a_checkpoint_in_the_bucket_manifest_last(
        bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Ray Train rank 0 writes ``<checkpoint_uri_prefix>/step_XXXXXXXX`` itself (no ``ray.train.report``):
    the data objects first, the manifest last, and an overwrite drops the old manifest before anything else."""
    from contracts.storage import Location
    from contracts.wire import AttemptSpec
    from tests.recipes import build_recipe
    from workers.checkpoint import encode_checkpoint, write_checkpoint
    from workers.checkpointing import Checkpointer
    from workers.context import WorkerContext
    from workers.faults import FaultInjector
    from workers.sinks import ListSink

    class State:
        def rank_part(self) -> dict[str, object]:
            return {"rng": {}, "comm_hook": {}}

        @staticmethod
        def node_of(ctx: WorkerContext) -> str:
            return "n"

        def state_dict(self, per_rank: object, progress: dict[str, object]) -> dict[str, object]:
            return {"model": {"w": torch.full((64,), 3.0)}, "progress": progress}

    recipe = build_recipe({"name": "s3-writer"})
    prefix = f"{bucket.root}/run-1-attempt-1"
    ctx = WorkerContext(ray_train=True, checkpoint_uri_prefix=prefix, storage=bucket.storage)
    sink = ListSink()
    c = Checkpointer(AttemptSpec(recipe=recipe, checkpoint_dir=str(tmp_path / "unused")), ctx, sink,
                     FaultInjector(recipe.faults, attempt=1, rank=0))
    c.save(10, State(), healthy=True, verdict={}, loss=1.0, pending_update_ratio=None,  # type: ignore[arg-type]
           on_saved=lambda saved: None)
    c.drain()
    c.close()
    (event,) = sink.of_type("checkpoint")
    assert event["uri"] == f"{prefix}/step_00000010" and bucket.checkpoint_prefixes() == {event["uri"]}
    assert verify_checkpoint(event["uri"], expected_sha256=event["sha256"], storage=bucket.storage).step == 10
    assert not (tmp_path / "unused").exists()

    puts: list[str] = []
    where = Location(event["uri"], bucket.storage)
    real_write = Location.write_bytes

    def recording(self: Location, name: str, data: bytes) -> None:
        puts.append(name)
        if name != "manifest.json":  # mid-overwrite: the old manifest is already gone, the prefix is no checkpoint
            with pytest.raises(CorruptCheckpoint):
                read_manifest(event["uri"], storage=bucket.storage)
        real_write(self, name, data)

    encoded = encode_checkpoint({"model": {"w": torch.zeros(8)}}, {"step": 10, "healthy": False})
    monkeypatch.setattr(Location, "write_bytes", recording)
    write_checkpoint(where, encoded)
    assert puts == ["model.pt", "manifest.json"]
    assert verify_checkpoint(event["uri"], expected_sha256=encoded.sha256, storage=bucket.storage).healthy is False


def test_settings_carry_the_endpoint_and_keys_but_never_print_the_secret(bucket: Bucket) -> None:
    settings = Settings(**bucket.settings_kwargs())
    storage = settings.checkpoint_storage()
    assert storage == bucket.storage
    assert "testing" not in repr(settings.s3_secret_access_key) and "secret_access_key" not in repr(storage)


def test_a_local_root_is_refused_on_several_nodes_unless_declared_shared(tmp_path: Path) -> None:
    local = Settings(home=tmp_path, checkpoint_root=str(tmp_path / "ckpt"))
    assert local.checkpoint_root_refusal(1) is None
    refusal = local.checkpoint_root_refusal(2)
    assert refusal is not None and "is a local path, but the Ray cluster has 2 nodes" in refusal
    assert "BALLAST_CHECKPOINT_ROOT_SHARED=true" in refusal
    assert Settings(home=tmp_path, checkpoint_root=str(tmp_path), checkpoint_root_shared=True
                    ).checkpoint_root_refusal(3) is None
    assert Settings(home=tmp_path, checkpoint_root="s3://b/p").checkpoint_root_refusal(3) is None


def test_without_settings_the_aws_environment_reaches_the_store(bucket: Bucket, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """What the Helm chart sets on the scheduler and every Ray pod: the AWS SDK's variables, no BALLAST_S3_*."""
    uris = upload(bucket, tmp_path, [(10, True)])
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", bucket.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    assert verify_checkpoint(uris[10]).step == 10  # no StorageOptions at all
    assert scheduler_verify(uris[10], None, storage=Settings().checkpoint_storage()) is None
