"""The session's local S3 server (moto, started by the tests) and a fresh bucket per test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.storage.s3 import Bucket, new_bucket, start_server


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    server, endpoint = start_server()
    yield endpoint
    server.stop()


@pytest.fixture
def bucket(s3_endpoint: str) -> Bucket:
    return new_bucket(s3_endpoint)
