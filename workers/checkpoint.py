"""Writing and loading checkpoints: atomic, checksummed, loadable without unpickling arbitrary objects.

The format (layout, manifest, verification, retention) is ``contracts/checkpoint.py``; this module adds what
needs torch: saving state dicts and unpickling them weights-only after verification.

State format: ``state`` is a ``dict[str, Any]`` whose keys are file stems (letters, digits, ``_ - .``) and whose
values hold only what ``torch.load(weights_only=True)`` accepts: tensors, dicts, lists, tuples, str, int, float,
bool, None, bytes, ``torch.Size``/``dtype``/``device``. ``save_checkpoint`` checks this up front and names the
offending path (e.g. a numpy scalar in detector state), so a checkpoint that cannot be loaded is never written.
Tensors load onto the CPU.

Saving writes everything into a hidden temporary directory next to the target, fsyncs each file, writes the
manifest last, fsyncs, and renames the directory into place, so a crash leaves either a complete checkpoint or none.
``attach`` adds directories of files already written (FSDP's shards from every rank:
``workers/sharded_checkpoint.py``) under a subdirectory name: their files are moved in (uploaded, on an object
store) before the manifest, which lists them (``<name>/<file>``) with their checksums like the state parts, so
verification, retention and deletion treat them alike.
The same steps split for a background writer: ``check_state`` (on the caller's thread), ``encode_checkpoint``
(bytes and checksums) and ``write_checkpoint`` (to a ``Location``: locally as above, on an object store the data
objects first and the manifest last).
Loading verifies the manifest's own checksum and every file's sha256 before unpickling and raises
:class:`CorruptCheckpoint` otherwise. ``CheckpointInfo.sha256`` is the manifest checksum: one digest that
identifies the whole checkpoint (the control plane stores it and may pass it back as ``expected_sha256``).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import re
import shutil
import uuid
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from contracts.checkpoint import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    CorruptCheckpoint,
    Manifest,
    canonical_json,
    check_expected,
    file_sha256,
    read_manifest,
    verify_files,
)
from contracts.storage import Location

_KEY_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$")
_LEAF_TYPES = (str, int, float, bool, bytes, type(None), torch.Size, torch.dtype, torch.device)


@dataclass(frozen=True)
class CheckpointInfo:
    path: Path
    sha256: str
    """Checksum of the manifest, which lists every file's sha256: identifies the whole checkpoint."""
    step: int
    healthy: bool


def _check_weights_only(obj: Any, path: str) -> None:
    # exact types: subclasses such as numpy.float64 (a float) or defaultdict (a dict) fail weights-only loading
    kind = type(obj)
    if isinstance(obj, torch.Tensor) or kind in _LEAF_TYPES:
        return
    if kind is dict or kind is OrderedDict:
        for k, v in obj.items():
            if type(k) not in (str, int, float, bool, type(None)):
                raise TypeError(f"{path}: dict key {k!r} of type {type(k).__name__} cannot be loaded weights-only")
            _check_weights_only(v, f"{path}[{k!r}]")
        return
    if kind is list or kind is tuple:
        for i, v in enumerate(obj):
            _check_weights_only(v, f"{path}[{i}]")
        return
    raise TypeError(
        f"{path}: {kind.__module__}.{kind.__qualname__} cannot be loaded weights-only; "
        "store tensors, numbers, strings and lists/dicts of them"
    )


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


def check_state(state: dict[str, Any], meta: dict[str, Any]) -> None:
    """Refuse, naming the offending path, a state or meta that would make an unloadable checkpoint (see the
    module docstring): ``save_checkpoint`` calls it, and the background writer's caller calls it before handing
    the state over, so the mistake surfaces in the training loop rather than in a thread."""
    step = meta.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"meta['step'] must be an int >= 0, got {step!r}")
    healthy = meta.get("healthy", False)
    if not isinstance(healthy, bool):
        raise ValueError(f"meta['healthy'] must be a bool, got {healthy!r}")
    if not isinstance(state, dict) or not state:
        raise ValueError("state must be a non-empty dict of named parts (e.g. {'model': ..., 'optimizer': ...})")
    for key, value in state.items():
        if not isinstance(key, str) or not _KEY_RE.match(key):
            raise ValueError(f"state key {key!r}: use letters, digits, '_', '-', '.' (it becomes a file name)")
        _check_weights_only(value, f"state[{key!r}]")
    try:
        json.dumps(meta)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"meta must be JSON-serialisable: {exc}") from exc


@dataclass(frozen=True)
class EncodedCheckpoint:
    """A checkpoint as bytes, ready to be written: one file per state part, then the manifest that lists them."""

    files: dict[str, bytes]
    manifest: bytes
    attached: dict[str, Path]
    """Manifest name (``<sub>/<relative path>``) → the already written file that goes there (``attach``)."""
    sha256: str
    """The manifest's checksum (``CheckpointInfo.sha256``)."""
    step: int
    healthy: bool


def _attached_files(attach: Mapping[str, Path] | None) -> dict[str, Path]:
    """``attach`` (subdirectory name → a directory of written files) → manifest name → file."""
    out: dict[str, Path] = {}
    for sub, src in (attach or {}).items():
        if not _KEY_RE.match(sub) or sub == MANIFEST or sub.endswith(".pt"):
            raise ValueError(f"attach name {sub!r}: use letters, digits, '_', '-', '.' and no .pt suffix")
        root = Path(src)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            out[f"{sub}/{path.relative_to(root).as_posix()}"] = path
    return out


def encode_checkpoint(state: dict[str, Any], meta: dict[str, Any],
                      attach: Mapping[str, Path] | None = None) -> EncodedCheckpoint:
    """Serialise a checked state (``check_state``): ``torch.save`` per part, each file's sha256 (the attached
    files' too), the manifest."""
    step, healthy = int(meta["step"]), bool(meta.get("healthy", False))
    blobs: dict[str, bytes] = {}
    files: dict[str, dict[str, Any]] = {}
    for key, value in state.items():
        buf = io.BytesIO()
        torch.save(value, buf)
        data = buf.getvalue()
        name = f"{key}.pt"
        blobs[name] = data
        files[name] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    attached = _attached_files(attach)
    for name, path in attached.items():
        files[name] = {"sha256": file_sha256(path), "bytes": path.stat().st_size}
    body = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": step,
        "healthy": healthy,
        "created_at": datetime.now(UTC).isoformat(),
        "keys": list(state),
        "files": files,
        "meta": meta,
    }
    checksum = hashlib.sha256(canonical_json(body)).hexdigest()
    manifest = json.dumps({**body, "checksum": checksum}, indent=2, sort_keys=True).encode()
    return EncodedCheckpoint(files=blobs, manifest=manifest, attached=attached, sha256=checksum, step=step,
                             healthy=healthy)


def save_checkpoint(
    directory: str | Path, state: dict[str, Any], *, meta: dict[str, Any], overwrite: bool = False,
    attach: Mapping[str, Path] | None = None,
) -> CheckpointInfo:
    """Write ``state`` atomically to ``directory`` (which must not exist, or be empty, unless ``overwrite``).

    ``meta`` must be JSON-serialisable (NaN allowed) and contain ``step`` (int >= 0); ``healthy`` (bool, default
    False) is the health verdict the retention rule reads; anything else (verdict reasons, metrics) is kept.
    ``attach``: directories of written files moved in under those names (module docstring).
    """
    target = Path(directory)
    check_state(state, meta)
    if target.exists() and not overwrite and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"checkpoint directory {target} already exists and is not empty")
    encoded = encode_checkpoint(state, meta, attach)
    _commit_local(target, encoded)
    return CheckpointInfo(path=target, sha256=encoded.sha256, step=encoded.step, healthy=encoded.healthy)


def write_checkpoint(where: Location, encoded: EncodedCheckpoint) -> None:
    """Write an encoded checkpoint to a local directory or an object-store prefix, replacing what is there, so
    that no reader ever finds a partial one under the name.

    Locally: a hidden temporary directory next to the target, every file fsynced, the manifest last, then a
    rename. On an object store (no rename): the old manifest is deleted first, the data files are put, the
    manifest last; a prefix without a manifest fails verification, so it is never resumed from nor registered.
    """
    if where.local is not None:
        _commit_local(where.local, encoded)
        return
    import pyarrow.fs as pafs

    fs, path = where.storage.filesystem(where.uri)
    if fs.get_file_info(f"{path}/{MANIFEST}").type == pafs.FileType.File:
        fs.delete_file(f"{path}/{MANIFEST}")
    fs.create_dir(path, recursive=True)
    for name, data in encoded.files.items():
        where.write_bytes(name, data)
    for name, src in encoded.attached.items():
        where.write_bytes(name, src.read_bytes())
    where.write_bytes(MANIFEST, encoded.manifest)


def _commit_local(target: Path, encoded: EncodedCheckpoint) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:12]}"
    tmp.mkdir()
    try:
        for name, data in encoded.files.items():
            _write_synced(tmp / name, data)
        for name, src in encoded.attached.items():
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(src), str(tmp / name))
        for sub in {name.split("/", 1)[0] for name in encoded.attached}:
            for d in sorted({p for p in (tmp / sub).rglob("*") if p.is_dir()} | {tmp / sub}, reverse=True):
                _fsync_dir(d)
        _write_synced(tmp / MANIFEST, encoded.manifest)
        _fsync_dir(tmp)
        if target.exists():
            if target.is_dir() and not any(target.iterdir()):
                target.rmdir()
            else:  # overwrite: move the old one aside first, so the name never points at a half-written dir
                trash = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:12]}"
                target.rename(trash)
                shutil.rmtree(trash, ignore_errors=True)
        os.rename(tmp, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_checkpoint(
    directory: str | Path, *, expected_sha256: str | None = None, keys: Sequence[str] | None = None
) -> tuple[dict[str, Any], Manifest]:
    """Verify and load a checkpoint → (state, manifest). Raises CorruptCheckpoint with the reason.

    ``expected_sha256`` (the ``CheckpointInfo.sha256`` recorded at save time) also guards against a checkpoint
    replaced by a different, internally consistent one. ``keys`` loads only those parts of the state.
    """
    path = Path(directory)
    manifest = read_manifest(path)
    check_expected(path, manifest, expected_sha256)
    wanted = None if keys is None else {f"{k}.pt" for k in keys}
    if wanted is not None and not wanted <= set(manifest.files):
        missing = sorted(k.removesuffix(".pt") for k in wanted - set(manifest.files))
        raise KeyError(f"checkpoint {path} has no state part(s) {missing}")
    order = manifest.raw.get("keys")
    names = [f"{k}.pt" for k in order] if isinstance(order, list) else sorted(manifest.files)
    if set(names) != {n for n in manifest.files if "/" not in n}:  # files in a subdirectory: attached (shards)
        raise CorruptCheckpoint(path, f"{MANIFEST} lists keys that do not match its files")
    blobs = verify_files(path, manifest, [n for n in names if wanted is None or n in wanted])
    state: dict[str, Any] = {}
    for name, data in blobs.items():
        try:
            value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except Exception as exc:
            raise CorruptCheckpoint(path, f"{name} cannot be loaded weights-only: {type(exc).__name__}: {exc}") from exc
        state[name.removesuffix(".pt")] = value
    return state, manifest


def rng_state() -> dict[str, Any]:
    """Python, numpy and torch (CPU and CUDA) RNG states as tensors and primitives (weights-only loadable)."""
    version, mt, gauss = random.getstate()
    state: dict[str, Any] = {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss_next": gauss},
        "torch": torch.get_rng_state(),
    }
    try:
        import numpy as np
    except ImportError:  # numpy is optional
        pass
    else:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {
            "name": str(name),
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        }
    if torch.cuda.is_available():
        state["cuda"] = list(torch.cuda.get_rng_state_all())
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore states captured by :func:`rng_state` (parts absent from ``state`` are left alone)."""
    if "python" in state:
        py = state["python"]
        random.setstate((int(py["version"]), tuple(int(x) for x in py["state"].tolist()), py["gauss_next"]))
    if "torch" in state:
        torch.set_rng_state(state["torch"].cpu())
    if "numpy" in state:
        import numpy as np

        npst = state["numpy"]
        np.random.set_state(
            (npst["name"], npst["keys"].numpy().astype(np.uint32), int(npst["pos"]), int(npst["has_gauss"]),
             float(npst["cached_gaussian"]))
        )
    if "cuda" in state and torch.cuda.is_available():
        cuda_states = list(state["cuda"])
        if len(cuda_states) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([s.cpu() for s in cuda_states])
