"""The checkpoint format: the manifest, its verification and the retention rule (no torch needed to read them).

Layout of one checkpoint directory::

    step_00000050/
        manifest.json      format version, step, health verdict, meta, sha256 + size of every file, self-checksum
        model.pt           one ``torch.save`` file per top-level key of the state dict
        optimizer.pt
        ...

The control plane reads manifests, verifies files and applies retention without importing torch; the workers'
``workers/checkpoint.py`` writes checkpoints and unpickles them after :func:`verify_files` passed.
``Manifest.sha256`` is the manifest's own checksum: one digest that identifies the whole checkpoint (the store
keeps it and passes it back as ``expected_sha256``).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

FORMAT = "ballast-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CorruptCheckpoint(Exception):
    """A checkpoint that must not be used: missing, incomplete, or failing its checksums.

    Picklable (``__reduce__``), so it crosses Ray's process boundary with its path and reason intact.
    """

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"corrupt checkpoint {self.path}: {reason}")

    def __reduce__(self) -> tuple[Any, ...]:
        return (type(self), (self.path, self.reason))


@dataclass(frozen=True)
class Manifest:
    step: int
    healthy: bool
    meta: dict[str, Any]
    files: dict[str, dict[str, Any]]
    """File name → {"sha256": hex, "bytes": size}."""
    sha256: str
    """The manifest's own checksum (``CheckpointInfo.sha256``)."""
    created_at: str = ""
    format_version: int = FORMAT_VERSION
    raw: dict[str, Any] = field(default_factory=dict, repr=False)



def canonical_json(obj: dict[str, Any]) -> bytes:
    # NaN/Infinity are allowed (Python's JSON dialect): a diverged step's verdict may legitimately hold a NaN loss
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def read_manifest(directory: str | Path) -> Manifest:
    """Read and verify the manifest alone (its format and self-checksum), without touching the data files."""
    path = Path(directory)
    if not path.is_dir():
        raise CorruptCheckpoint(path, "no such checkpoint directory")
    mpath = path / MANIFEST
    if not mpath.is_file():
        raise CorruptCheckpoint(path, f"{MANIFEST} is missing (the save never completed?)")
    try:
        raw = json.loads(mpath.read_bytes())
    except (OSError, ValueError) as exc:
        raise CorruptCheckpoint(path, f"{MANIFEST} is unreadable: {exc}") from exc
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise CorruptCheckpoint(path, f"{MANIFEST} is not a Ballast checkpoint manifest")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise CorruptCheckpoint(path, f"unsupported format_version {version!r} (this build reads {FORMAT_VERSION})")
    checksum = raw.get("checksum")
    body = {k: v for k, v in raw.items() if k != "checksum"}
    actual = hashlib.sha256(canonical_json(body)).hexdigest()
    if checksum != actual:
        raise CorruptCheckpoint(path, f"{MANIFEST} checksum mismatch (manifest was modified or damaged)")
    files = raw.get("files")
    step = raw.get("step")
    if not isinstance(files, dict) or not files or not isinstance(step, int):
        raise CorruptCheckpoint(path, f"{MANIFEST} lacks files or step")
    return Manifest(
        step=step,
        healthy=bool(raw.get("healthy", False)),
        meta=dict(raw.get("meta") or {}),
        files=files,
        sha256=actual,
        created_at=str(raw.get("created_at", "")),
        format_version=version,
        raw=raw,
    )


def local_dir(uri: str) -> Path | None:
    """The local directory a checkpoint URI names (a plain path or ``file://``), or None for a remote URI."""
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    return None if "://" in uri else Path(uri)


def verify_files(
    directory: str | Path, manifest: Manifest, names: Iterable[str] | None = None
) -> dict[str, bytes]:
    """Read the manifest's files (or only ``names``), checking each one's size and sha256 → {name: bytes}.

    Raises CorruptCheckpoint naming the first file that is missing, truncated or damaged.
    """
    path = Path(directory)
    out: dict[str, bytes] = {}
    for name in manifest.files if names is None else names:
        entry = manifest.files[name]
        try:
            data = (path / name).read_bytes()
        except FileNotFoundError:
            raise CorruptCheckpoint(path, f"{name} is missing") from None
        except OSError as exc:
            raise CorruptCheckpoint(path, f"{name} is unreadable: {exc}") from exc
        if len(data) != entry.get("bytes"):
            raise CorruptCheckpoint(path, f"{name} has {len(data)} bytes, the manifest says {entry.get('bytes')} "
                                          "(truncated or overwritten)")
        if hashlib.sha256(data).hexdigest() != entry.get("sha256"):
            raise CorruptCheckpoint(path, f"{name} sha256 mismatch (damaged contents)")
        out[name] = data
    return out


def verify_checkpoint(directory: str | Path, *, expected_sha256: str | None = None) -> Manifest:
    """Verify a whole checkpoint (manifest, recorded digest, every file) → its manifest; raises CorruptCheckpoint."""
    manifest = read_manifest(directory)
    check_expected(directory, manifest, expected_sha256)
    verify_files(directory, manifest)
    return manifest


def check_expected(directory: str | Path, manifest: Manifest, expected_sha256: str | None) -> None:
    """The recorded digest also guards against a checkpoint replaced by a different, consistent one."""
    if expected_sha256 is not None and manifest.sha256 != expected_sha256:
        raise CorruptCheckpoint(
            directory, f"checkpoint sha256 {manifest.sha256} differs from the recorded {expected_sha256}"
        )


def checkpoints_to_delete(entries: Sequence[tuple[int, bool]], *, keep: int, keep_healthy: bool) -> list[int]:
    """Steps to delete from ``entries`` = [(step, healthy), ...]: keep the newest ``keep`` and, when
    ``keep_healthy``, also the newest healthy one (however old), since a rollback needs it. Sorted ascending."""
    if keep < 0:
        raise ValueError(f"keep must be >= 0, got {keep}")
    steps = [s for s, _ in entries]
    if len(set(steps)) != len(steps):
        raise ValueError(f"duplicate checkpoint steps in {sorted(steps)}")
    newest_first = sorted(entries, key=lambda e: e[0], reverse=True)
    kept = {s for s, _ in newest_first[:keep]}
    if keep_healthy:
        newest_healthy = next((s for s, ok in newest_first if ok), None)
        if newest_healthy is not None:
            kept.add(newest_healthy)
    return sorted(s for s in steps if s not in kept)


def list_checkpoints(root_dir: str | Path) -> list[tuple[Path, Manifest]]:
    """Complete checkpoints directly under ``root_dir`` (valid manifest), oldest first. Hidden temporaries and
    directories without a readable manifest are not listed."""
    root = Path(root_dir)
    if not root.is_dir():
        return []
    found: list[tuple[Path, Manifest]] = []
    for child in root.iterdir():
        if child.name.startswith(".") or not child.is_dir():
            continue
        try:
            found.append((child, read_manifest(child)))
        except CorruptCheckpoint:
            continue
    return sorted(found, key=lambda pm: pm[1].step)


def latest_checkpoint(root_dir: str | Path, *, healthy_only: bool = False) -> tuple[Path, Manifest] | None:
    """The newest checkpoint under ``root_dir`` (optionally the newest healthy one), or None."""
    for path, manifest in reversed(list_checkpoints(root_dir)):
        if manifest.healthy or not healthy_only:
            return path, manifest
    return None


def apply_retention(root_dir: str | Path, keep: int, keep_healthy: bool) -> list[Path]:
    """Delete the checkpoints under ``root_dir`` that :func:`checkpoints_to_delete` names (plain-process runs;
    under Ray Train its ``CheckpointConfig`` does this). Each is renamed to a hidden name first, so a crash
    mid-delete never leaves a half-deleted directory that looks like a checkpoint. Returns the deleted paths."""
    listed = list_checkpoints(root_dir)
    by_step = {m.step: p for p, m in listed}
    if len(by_step) != len(listed):
        raise ValueError(f"two checkpoints under {root_dir} have the same step")
    doomed = checkpoints_to_delete([(m.step, m.healthy) for _, m in listed], keep=keep, keep_healthy=keep_healthy)
    deleted: list[Path] = []
    for step in doomed:
        path = by_step[step]
        trash = path.parent / f".{path.name}.deleting-{uuid.uuid4().hex[:12]}"
        path.rename(trash)
        shutil.rmtree(trash, ignore_errors=True)
        deleted.append(path)
    return deleted
