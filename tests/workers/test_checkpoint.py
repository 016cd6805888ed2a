"""Checkpoints: round trip, every corruption refused, atomic saves, the retention rule, RNG capture."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from contracts.checkpoint import (
    CorruptCheckpoint,
    apply_retention,
    checkpoints_to_delete,
    latest_checkpoint,
    list_checkpoints,
    read_manifest,
)
from workers.checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state


def _state() -> dict[str, Any]:
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "scaler": {"scale": 65536.0, "growth_tracker": 3},
        "detectors": {"ema": torch.tensor([0.5, 0.25], dtype=torch.float64), "count": 7, "flags": [True, None]},
        "data": {"step": 50, "offset": 0},
    }


def _assert_same(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            _assert_same(a[k], b[k])
    elif isinstance(a, list | tuple):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            _assert_same(x, y)
    else:
        assert a == b


def test_round_trip(tmp_path: Path) -> None:
    state = _state()
    info = save_checkpoint(tmp_path / "step_00000050", state, meta={"step": 50, "healthy": True, "loss": 1.5})
    assert (info.step, info.healthy, info.path) == (50, True, tmp_path / "step_00000050")
    loaded, manifest = load_checkpoint(info.path, expected_sha256=info.sha256)
    _assert_same(state, loaded)
    assert manifest.step == 50 and manifest.healthy and manifest.meta["loss"] == 1.5
    assert manifest.sha256 == info.sha256
    assert set(manifest.files) == {f"{k}.pt" for k in state}
    # and the optimizer state really restores into a fresh optimizer
    model = torch.nn.Linear(4, 3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.load_state_dict(loaded["model"])
    opt.load_state_dict(loaded["optimizer"])


def test_load_selected_keys(tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path / "c", _state(), meta={"step": 1})
    loaded, _ = load_checkpoint(info.path, keys=["model"])
    assert list(loaded) == ["model"]
    with pytest.raises(KeyError, match="nope"):
        load_checkpoint(info.path, keys=["nope"])


def test_nan_in_meta_is_kept(tmp_path: Path) -> None:
    info = save_checkpoint(tmp_path / "c", {"x": torch.zeros(1)}, meta={"step": 3, "loss": float("nan")})
    _, manifest = load_checkpoint(info.path)
    assert manifest.meta["loss"] != manifest.meta["loss"]  # NaN survives (a diverged step's verdict may hold one)


# --------------------------------------------------------------------------------------------- corruption
def _saved(tmp_path: Path) -> Path:
    return save_checkpoint(tmp_path / "step_00000010", _state(), meta={"step": 10, "healthy": True}).path


def test_flipped_byte_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    f = path / "model.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpoint, match=r"model\.pt sha256 mismatch") as exc:
        load_checkpoint(path)
    assert exc.value.path == str(path) and "sha256" in exc.value.reason


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    f = path / "optimizer.pt"
    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(CorruptCheckpoint, match=r"optimizer\.pt has 100 bytes.*truncated"):
        load_checkpoint(path)


@pytest.mark.parametrize(("remove", "message"), [("manifest.json", "manifest.json is missing"),
                                                 ("scaler.pt", r"scaler\.pt is missing")])
def test_missing_file_is_refused(tmp_path: Path, remove: str, message: str) -> None:
    path = _saved(tmp_path)
    (path / remove).unlink()
    with pytest.raises(CorruptCheckpoint, match=message):
        load_checkpoint(path)


def test_missing_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CorruptCheckpoint, match="no such checkpoint directory"):
        load_checkpoint(tmp_path / "nowhere")


def test_edited_manifest_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    raw = json.loads((path / "manifest.json").read_text())
    raw["step"] = 11  # a consistent-looking lie: only the self-checksum catches it
    (path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CorruptCheckpoint, match="manifest.json checksum mismatch"):
        load_checkpoint(path)


def test_garbled_manifest_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    (path / "manifest.json").write_bytes(b"{not json")
    with pytest.raises(CorruptCheckpoint, match="manifest.json is unreadable"):
        load_checkpoint(path)


def test_expected_sha256_mismatch_is_refused(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    with pytest.raises(CorruptCheckpoint, match="differs from the recorded"):
        load_checkpoint(path, expected_sha256="0" * 64)


def test_unsafe_pickle_with_matching_checksums_is_refused(tmp_path: Path) -> None:
    """Checksums prove integrity, not safety: weights-only loading still refuses arbitrary objects."""
    import hashlib
    import io

    path = _saved(tmp_path)
    buf = io.BytesIO()
    torch.save({"obj": Path("x")}, buf)  # a non-allow-listed class
    data = buf.getvalue()
    (path / "data.pt").write_bytes(data)
    raw = json.loads((path / "manifest.json").read_text())
    raw["files"]["data.pt"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    body = {k: v for k, v in raw.items() if k != "checksum"}
    raw["checksum"] = hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(raw))
    with pytest.raises(CorruptCheckpoint, match=r"data\.pt cannot be loaded weights-only"):
        load_checkpoint(path)


# ------------------------------------------------------------------------------------------------- saving
def test_state_that_cannot_load_weights_only_is_refused_at_save(tmp_path: Path) -> None:
    bad = {"model": {"w": torch.zeros(2)}, "detectors": {"ema": np.float64(1.0)}}
    with pytest.raises(TypeError, match=r"state\['detectors'\]\['ema'\]: numpy.float64"):
        save_checkpoint(tmp_path / "c", bad, meta={"step": 1})
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary


def test_failed_save_leaves_no_checkpoint_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_save = torch.save
    calls = {"n": 0}

    def flaky_save(obj: Any, f: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 3:
            raise OSError("disk full")
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", flaky_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(tmp_path / "step_00000005", _state(), meta={"step": 5})
    assert list(tmp_path.iterdir()) == []


def test_existing_checkpoint_is_not_overwritten_unless_asked(tmp_path: Path) -> None:
    first = save_checkpoint(tmp_path / "c", {"x": torch.zeros(1)}, meta={"step": 1})
    with pytest.raises(FileExistsError):
        save_checkpoint(tmp_path / "c", {"x": torch.ones(1)}, meta={"step": 1})
    second = save_checkpoint(tmp_path / "c", {"x": torch.ones(1)}, meta={"step": 1}, overwrite=True)
    assert second.sha256 != first.sha256
    assert torch.equal(load_checkpoint(tmp_path / "c")[0]["x"], torch.ones(1))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_empty_target_directory_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "c").mkdir()  # e.g. a fresh tempfile.mkdtemp() for a Ray checkpoint
    save_checkpoint(tmp_path / "c", {"x": torch.zeros(1)}, meta={"step": 1})
    assert read_manifest(tmp_path / "c").step == 1


@pytest.mark.parametrize(
    ("state", "meta", "message"),
    [
        ({"x": torch.zeros(1)}, {}, r"meta\['step'\]"),
        ({"x": torch.zeros(1)}, {"step": -1}, r"meta\['step'\]"),
        ({"x": torch.zeros(1)}, {"step": 1, "healthy": "yes"}, r"meta\['healthy'\]"),
        ({"x": torch.zeros(1)}, {"step": 1, "t": object()}, "JSON-serialisable"),
        ({"../x": torch.zeros(1)}, {"step": 1}, "state key"),
        ({}, {"step": 1}, "non-empty dict"),
    ],
)
def test_bad_save_arguments(tmp_path: Path, state: dict[str, Any], meta: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        save_checkpoint(tmp_path / "c", state, meta=meta)


# ----------------------------------------------------------------------------------------------- retention
@pytest.mark.parametrize(
    ("entries", "keep", "keep_healthy", "expected"),
    [
        ([], 3, True, []),
        ([(10, True), (20, True), (30, True)], 3, True, []),
        ([(10, True), (20, True), (30, True), (40, True)], 2, True, [10, 20]),
        # newest healthy (20) is older than the K newest: kept anyway
        ([(10, True), (20, True), (30, False), (40, False), (50, False)], 2, True, [10, 30]),
        ([(10, True), (20, True), (30, False), (40, False), (50, False)], 2, False, [10, 20, 30]),
        # only unhealthy: plain keep-K
        ([(10, False), (20, False), (30, False)], 1, True, [10, 20]),
        # the newest healthy is already among the K newest: nothing extra
        ([(10, True), (20, False), (30, True)], 2, True, [10]),
        # order of entries does not matter
        ([(50, False), (10, True), (30, False), (20, True), (40, False)], 2, True, [10, 30]),
        ([(10, True), (20, False)], 0, True, [20]),
    ],
)
def test_retention_rule(entries: list[tuple[int, bool]], keep: int, keep_healthy: bool, expected: list[int]) -> None:
    assert checkpoints_to_delete(entries, keep=keep, keep_healthy=keep_healthy) == expected


def test_retention_rule_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="duplicate"):
        checkpoints_to_delete([(1, True), (1, False)], keep=1, keep_healthy=True)
    with pytest.raises(ValueError, match="keep"):
        checkpoints_to_delete([(1, True)], keep=-1, keep_healthy=True)


def test_apply_retention_on_disk(tmp_path: Path) -> None:
    for step, healthy in [(10, True), (20, True), (30, False), (40, False), (50, False)]:
        save_checkpoint(tmp_path / f"step_{step:08d}", {"x": torch.tensor([step])}, meta={"step": step,
                                                                                           "healthy": healthy})
    (tmp_path / "not_a_checkpoint").mkdir()  # unrelated directories are never touched
    deleted = apply_retention(tmp_path, keep=2, keep_healthy=True)
    assert sorted(p.name for p in deleted) == ["step_00000010", "step_00000030"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_checkpoint", "step_00000020", "step_00000040",
                                                          "step_00000050"]
    assert [m.step for _, m in list_checkpoints(tmp_path)] == [20, 40, 50]
    newest_healthy = latest_checkpoint(tmp_path, healthy_only=True)
    assert newest_healthy is not None and newest_healthy[1].step == 20
    newest = latest_checkpoint(tmp_path)
    assert newest is not None and newest[1].step == 50


# ------------------------------------------------------------------------------------------------------ RNG
def _draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(3)


def test_rng_state_round_trips_through_a_weights_only_checkpoint(tmp_path: Path) -> None:
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.randn()
    info = save_checkpoint(tmp_path / "c", {"rng": rng_state()}, meta={"step": 0})
    expected = _draws()
    _draws()  # move every generator on
    set_rng_state(load_checkpoint(info.path)[0]["rng"])
    got = _draws()
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
