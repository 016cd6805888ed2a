"""A local S3-compatible server for the object-store tests: moto in server mode on 127.0.0.1 (a free port), and
the few helpers the tests and the multi-node script share (a bucket per test, its objects, settings for it)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from contracts.storage import StorageOptions

KEY, SECRET, REGION = "testing", "testing", "us-east-1"


@dataclass(frozen=True)
class Bucket:
    endpoint: str
    name: str

    @property
    def root(self) -> str:
        """The checkpoint root the tests use: a prefix in the bucket."""
        return f"s3://{self.name}/ballast"

    @property
    def storage(self) -> StorageOptions:
        return StorageOptions(endpoint=self.endpoint, access_key_id=KEY, secret_access_key=SECRET, region=REGION)

    def settings_kwargs(self) -> dict[str, Any]:
        """``Settings`` fields for a server whose checkpoints go to this bucket."""
        return {"checkpoint_root": self.root, "s3_endpoint": self.endpoint, "s3_access_key_id": KEY,
                "s3_secret_access_key": SECRET, "s3_region": REGION}

    def client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id=KEY, aws_secret_access_key=SECRET,
                            region_name=REGION)

    def keys(self, prefix: str = "") -> list[str]:
        pages = self.client().get_paginator("list_objects_v2").paginate(Bucket=self.name, Prefix=prefix)
        return sorted(obj["Key"] for page in pages for obj in page.get("Contents", []))

    def checkpoint_prefixes(self) -> set[str]:
        """``s3://bucket/.../step_XXXXXXXX`` of every checkpoint that has objects in the bucket."""
        return {f"s3://{self.name}/{key.rsplit('/', 1)[0]}" for key in self.keys()
                if key.rsplit("/", 2)[-2].startswith("step_")}


def start_server() -> tuple[Any, str]:
    """(server, endpoint): a threaded moto server on a free port of 127.0.0.1."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    return server, f"http://{host}:{port}"


def new_bucket(endpoint: str) -> Bucket:
    bucket = Bucket(endpoint=endpoint, name=f"ballast-{uuid.uuid4().hex[:12]}")
    bucket.client().create_bucket(Bucket=bucket.name)
    return bucket
