"""Keyset pagination: one page of a listing, and the opaque cursor that continues it."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class PageResult(Generic[T]):
    """One page of a keyset-paginated listing: the rows, the total matching the filters, the next cursor."""

    rows: list[T]
    count: int
    next_cursor: str | None


class BadCursor(ValueError):
    """A cursor that this listing did not produce (the API maps it to 422 naming ``cursor``)."""


def encode_cursor(*parts: Any) -> str:
    raw = json.dumps(list(parts), separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, kinds: tuple[type, ...]) -> list[Any]:
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
        parts = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise BadCursor("not a cursor from this listing") from None
    if not isinstance(parts, list) or len(parts) != len(kinds):
        raise BadCursor("not a cursor from this listing")
    out: list[Any] = []
    for part, kind in zip(parts, kinds, strict=True):
        if kind is datetime:
            if not isinstance(part, str):
                raise BadCursor("not a cursor from this listing")
            try:
                when = datetime.fromisoformat(part)
            except ValueError:
                raise BadCursor("not a cursor from this listing") from None
            out.append(when if when.tzinfo else when.replace(tzinfo=UTC))
        elif kind is int:
            if not isinstance(part, int) or isinstance(part, bool) or not 0 <= part < 2**63:
                raise BadCursor("not a cursor from this listing")
            out.append(part)
    return out
