"""Where checkpoints live: a local directory, or an object store (``s3://bucket/prefix``) reached through pyarrow's
filesystems (the layer Ray Train uses for its storage too). One ``Location`` type for both, so writing, reading a
manifest, verifying files, listing, corrupting (a fault) and deleting a checkpoint are written once.

``StorageOptions`` says how to reach the object store (endpoint and, optionally, explicit keys; otherwise the AWS
SDK's own chain: ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL_S3``, instance roles). It is
plain data that crosses process boundaries in the launch (scheduler → channel actor → workers).

pyarrow is imported only when a remote location is used: the control plane reads local checkpoints without it.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REMOTE_SCHEMES = ("s3://",)


def local_dir(uri: str) -> Path | None:
    """The local directory a checkpoint URI names (a plain path or ``file://``), or None for a remote URI."""
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    return None if "://" in uri else Path(uri)


@dataclass(frozen=True)
class StorageOptions:
    """How to reach the object store of ``s3://`` checkpoint URIs (ignored for local paths)."""

    endpoint: str = ""
    """``http(s)://host:port`` of an S3-compatible server (MinIO, moto); empty: AWS, or ``AWS_ENDPOINT_URL_S3``."""
    access_key_id: str = ""
    """Explicit credentials; empty: the AWS SDK's credential chain of each process that touches the bucket."""
    secret_access_key: str = field(default="", repr=False)
    region: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"endpoint": self.endpoint, "access_key_id": self.access_key_id,
                "secret_access_key": self.secret_access_key, "region": self.region}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> StorageOptions:
        data = data or {}
        return cls(**{k: str(data.get(k) or "") for k in ("endpoint", "access_key_id", "secret_access_key",
                                                          "region")})

    def filesystem(self, uri: str) -> tuple[Any, str]:
        """``(pyarrow FileSystem, path within it)`` for a remote URI (what Ray Train's ``storage_filesystem``
        and ``Checkpoint(path, filesystem)`` take)."""
        import pyarrow.fs as pafs

        if not uri.startswith(REMOTE_SCHEMES):
            fs, path = pafs.FileSystem.from_uri(uri)
            return fs, str(path)
        path = uri.split("://", 1)[1].rstrip("/")
        # pyarrow's constructor does not read the endpoint variables the AWS SDKs honour; its from_uri does
        endpoint = self.endpoint or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL", "")
        if not (endpoint or self.access_key_id or self.region):
            fs, _ = pafs.FileSystem.from_uri(uri)  # as Ray Train resolves it: the bucket's region looked up
            return fs, path
        kwargs: dict[str, Any] = {}
        if endpoint:
            kwargs["endpoint_override"] = endpoint
        if self.access_key_id:
            kwargs["access_key"] = self.access_key_id
            kwargs["secret_key"] = self.secret_access_key
        region = self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION", "")
        if region:
            kwargs["region"] = region
        return pafs.S3FileSystem(**kwargs), path


class Location:
    """A directory (or object-store prefix) and the few operations checkpoints need on it."""

    def __init__(self, where: str | Path, storage: StorageOptions | None = None) -> None:
        self.uri = str(where)
        self.storage = storage or StorageOptions()
        self.local = where if isinstance(where, Path) else local_dir(self.uri)
        self._fs: Any = None
        self._path = ""

    def __str__(self) -> str:
        return str(self.local) if self.local is not None else self.uri

    @property
    def name(self) -> str:
        return self.local.name if self.local is not None else self.uri.rstrip("/").rsplit("/", 1)[-1]

    def _remote(self) -> tuple[Any, str]:
        if self._fs is None:
            self._fs, self._path = self.storage.filesystem(self.uri)
        return self._fs, self._path

    def child(self, name: str) -> Location:
        if self.local is not None:
            return Location(self.local / name, self.storage)
        return Location(f"{self.uri.rstrip('/')}/{name}", self.storage)

    def is_dir(self) -> bool:
        if self.local is not None:
            return self.local.is_dir()
        import pyarrow.fs as pafs

        fs, path = self._remote()
        return bool(fs.get_file_info(path).type == pafs.FileType.Directory)

    def read_bytes(self, name: str) -> bytes:
        """A file's bytes; FileNotFoundError if it is not there."""
        if self.local is not None:
            return (self.local / name).read_bytes()
        fs, path = self._remote()
        try:
            with fs.open_input_stream(f"{path}/{name}") as f:
                return bytes(f.read())
        except FileNotFoundError:
            raise
        except OSError as exc:  # pyarrow reports a missing object as an OSError on some stores
            if "NoSuchKey" in str(exc) or "not found" in str(exc).lower():
                raise FileNotFoundError(f"{self.uri}/{name}") from exc
            raise

    def write_bytes(self, name: str, data: bytes) -> None:
        if self.local is not None:
            (self.local / name).write_bytes(data)
            return
        fs, path = self._remote()
        with fs.open_output_stream(f"{path}/{name}") as f:
            f.write(data)

    def files(self) -> dict[str, int]:
        """The files directly in this directory: name → size."""
        if self.local is not None:
            return {p.name: p.stat().st_size for p in self.local.iterdir() if p.is_file()}
        import pyarrow.fs as pafs

        fs, path = self._remote()
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return {i.base_name: int(i.size) for i in infos if i.type == pafs.FileType.File}

    def subdirs(self) -> list[Location]:
        """The directories directly under this one (none if it does not exist)."""
        if self.local is not None:
            if not self.local.is_dir():
                return []
            return [Location(c, self.storage) for c in sorted(self.local.iterdir()) if c.is_dir()]
        import pyarrow.fs as pafs

        fs, path = self._remote()
        infos = fs.get_file_info(pafs.FileSelector(path, allow_not_found=True))
        return [self.child(i.base_name) for i in sorted(infos, key=lambda i: i.base_name)
                if i.type == pafs.FileType.Directory]

    def remove(self) -> None:
        """Delete the directory and everything under it. Locally it is renamed to a hidden name first, so a crash
        mid-delete never leaves a half-deleted directory that looks like a checkpoint; on an object store the
        manifest goes first, for the same reason."""
        if self.local is not None:
            if not self.local.exists():
                return
            trash = self.local.parent / f".{self.local.name}.deleting-{uuid.uuid4().hex[:12]}"
            self.local.rename(trash)
            shutil.rmtree(trash, ignore_errors=True)
            return
        import pyarrow.fs as pafs

        fs, path = self._remote()
        if fs.get_file_info(path).type == pafs.FileType.NotFound:
            return
        manifest = f"{path}/manifest.json"
        if fs.get_file_info(manifest).type == pafs.FileType.File:
            fs.delete_file(manifest)
        fs.delete_dir(path)
