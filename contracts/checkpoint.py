"""The checkpoint format: the manifest, its verification and the retention rule (no torch needed to read them).

Layout of one checkpoint directory::

    step_00000050/
        manifest.json      format version, step, health verdict, meta, sha256 + size of every file, self-checksum
        model.pt           one ``torch.save`` file per top-level key of the state dict
        optimizer.pt
        ...
        shards/            only in a sharded (``distributed.strategy: fsdp``) checkpoint: the DCP files every rank
                           wrote (``.metadata``, ``__<rank>_0.distcp``) instead of model.pt and optimizer.pt; listed
                           in the manifest as ``shards/<file>`` and verified like the others; ``meta.shards`` says so

The control plane reads manifests, verifies files and applies retention without importing torch; the workers'
``workers/checkpoint.py`` writes checkpoints and unpickles them after :func:`verify_files` passed.
``Manifest.sha256`` is the manifest's own checksum: one digest that identifies the whole checkpoint (the store
keeps it and passes it back as ``expected_sha256``).

Every reader takes a path or a URI: local directories and object-store prefixes (``s3://bucket/...``, with
``contracts.storage.StorageOptions``) are read, verified, listed and deleted by the same code, through
``contracts.storage.Location``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from contracts.storage import Location, StorageOptions, local_dir

Where = str | Path | Location
"""A checkpoint directory: a local path, a URI (``s3://...``), or a ``Location``."""


def _at(where: Where, storage: StorageOptions | None) -> Location:
    return where if isinstance(where, Location) else Location(where, storage)

FORMAT = "ballast-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"


class CorruptCheckpoint(Exception):
    """A checkpoint that must not be used: missing, incomplete, or failing its checksums.

    Picklable (``__reduce__``), so it crosses Ray's process boundary with its path and reason intact.
    """

    def __init__(self, path: str | Path | Location, reason: str) -> None:
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


def read_manifest(directory: Where, *, storage: StorageOptions | None = None) -> Manifest:
    """Read and verify the manifest alone (its format and self-checksum), without touching the data files."""
    path = _at(directory, storage)
    try:
        data = path.read_bytes(MANIFEST)
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        if not path.is_dir():
            raise CorruptCheckpoint(path, "no such checkpoint directory") from None
        raise CorruptCheckpoint(path, f"{MANIFEST} is missing (the save never completed?)") from None
    except OSError as exc:
        raise CorruptCheckpoint(path, f"{MANIFEST} is unreadable: {exc}") from exc
    try:
        raw = json.loads(data)
    except ValueError as exc:
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


def verify_files(
    directory: Where, manifest: Manifest, names: Iterable[str] | None = None, *,
    storage: StorageOptions | None = None,
) -> dict[str, bytes]:
    """Read the manifest's files (or only ``names``), checking each one's size and sha256 → {name: bytes}.

    Raises CorruptCheckpoint naming the first file that is missing, truncated or damaged.
    """
    path = _at(directory, storage)
    out: dict[str, bytes] = {}
    for name in manifest.files if names is None else names:
        entry = manifest.files[name]
        try:
            data = path.read_bytes(name)
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


def file_sha256(path: Path) -> str:
    """The sha256 of a local file, read in 1 MiB blocks (a shard or an exported model may be large)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_checkpoint(directory: Where, *, expected_sha256: str | None = None,
                      storage: StorageOptions | None = None) -> Manifest:
    """Verify a whole checkpoint (manifest, recorded digest, every file) → its manifest; raises CorruptCheckpoint.
    Works on an object store too (``storage``): every file is read back and hashed."""
    path = _at(directory, storage)
    manifest = read_manifest(path)
    check_expected(path, manifest, expected_sha256)
    verify_files(path, manifest)
    return manifest


def check_expected(directory: Where, manifest: Manifest, expected_sha256: str | None) -> None:
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


def find_checkpoints(root: Where, *, storage: StorageOptions | None = None) -> list[tuple[Location, Manifest]]:
    """Complete checkpoints directly under ``root`` (valid manifest), oldest first, on disk or on an object
    store. Hidden temporaries and directories without a readable manifest are not listed."""
    found: list[tuple[Location, Manifest]] = []
    for child in _at(root, storage).subdirs():
        if child.name.startswith("."):
            continue
        try:
            found.append((child, read_manifest(child)))
        except CorruptCheckpoint:
            continue
    return sorted(found, key=lambda pm: pm[1].step)


def list_checkpoints(root_dir: str | Path) -> list[tuple[Path, Manifest]]:
    """:func:`find_checkpoints` of a local directory, as paths."""
    return [(loc.local, m) for loc, m in find_checkpoints(Path(root_dir)) if loc.local is not None]


def latest_checkpoint(root_dir: str | Path, *, healthy_only: bool = False) -> tuple[Path, Manifest] | None:
    """The newest checkpoint under ``root_dir`` (optionally the newest healthy one), or None."""
    for path, manifest in reversed(list_checkpoints(root_dir)):
        if manifest.healthy or not healthy_only:
            return path, manifest
    return None


def apply_retention(root_dir: Where, keep: int, keep_healthy: bool, *,
                    storage: StorageOptions | None = None) -> list[Location]:
    """Delete the checkpoints under ``root_dir`` that :func:`checkpoints_to_delete` names (plain-process runs;
    under Ray Train the scheduler retires them). Each goes through ``Location.remove`` (a crash mid-delete never
    leaves something that looks like a checkpoint). Returns the deleted locations."""
    listed = find_checkpoints(root_dir, storage=storage)
    by_step = {m.step: p for p, m in listed}
    if len(by_step) != len(listed):
        raise ValueError(f"two checkpoints under {root_dir} have the same step")
    doomed = checkpoints_to_delete([(m.step, m.healthy) for _, m in listed], keep=keep, keep_healthy=keep_healthy)
    deleted: list[Location] = []
    for step in doomed:
        by_step[step].remove()
        deleted.append(by_step[step])
    return deleted


__all__ = [
    "FORMAT", "FORMAT_VERSION", "MANIFEST", "CorruptCheckpoint", "Location", "Manifest", "StorageOptions",
    "apply_retention", "canonical_json", "check_expected", "checkpoints_to_delete", "find_checkpoints",
    "latest_checkpoint", "list_checkpoints", "local_dir", "read_manifest", "verify_checkpoint", "verify_files",
]
