"""The launch-time refusal of a local checkpoint root on a cluster of several nodes, without a cluster: the node
count is the one thing taken from Ray (the real two-node run is test_multinode.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchestrator.scheduler import launcher as launcher_mod
from orchestrator.scheduler.launcher import RayLauncher, UnsharedCheckpointRoot
from orchestrator.settings import Settings


def test_ray_launcher_refuses_an_unshared_local_root_before_asking_ray(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher_mod, "alive_nodes", lambda: 2)
    monkeypatch.setattr(launcher_mod, "channel_actor_class", lambda: pytest.fail("Ray was asked"))
    launcher = RayLauncher(Settings(home=tmp_path, checkpoint_root=str(tmp_path / "ckpt")))
    with pytest.raises(UnsharedCheckpointRoot, match="is a local path, but the Ray cluster has 2 nodes"):
        launcher.launch(name="n", run_id=1, attempt=1, launch={})


@pytest.mark.parametrize("settings", [{"checkpoint_root_shared": True}, {"checkpoint_root": "s3://b/p"}])
def test_shared_or_object_store_roots_pass_the_check(tmp_path: Path, settings: dict[str, object]) -> None:
    s = Settings(home=tmp_path, **{"checkpoint_root": str(tmp_path / "ckpt"), **settings})
    assert s.checkpoint_root_refusal(5) is None


def test_the_flag_is_read_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BALLAST_CHECKPOINT_ROOT", str(tmp_path / "nfs"))
    monkeypatch.setenv("BALLAST_CHECKPOINT_ROOT_SHARED", "true")
    assert Settings(home=tmp_path).checkpoint_root_refusal(2) is None
