"""The pure parts of the API's data-access functions: min/max downsampling and cursors."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from orchestrator.store.paging import BadCursor
from orchestrator.store.paging import decode_cursor as _decode_cursor
from orchestrator.store.paging import encode_cursor as _encode_cursor
from orchestrator.store.queries import downsample_min_max


def test_short_series_is_untouched() -> None:
    assert downsample_min_max([3.0, 1.0, 2.0], 10) == [0, 1, 2]


def test_one_step_spike_survives_heavy_downsampling() -> None:
    values = [1.0] * 10_000
    values[7_321] = 1e6
    values[2_000] = -5.0
    keep = downsample_min_max(values, 20)
    assert len(keep) <= 20
    assert 7_321 in keep and 2_000 in keep


def test_non_finite_values_are_kept() -> None:
    values = [1.0] * 1000
    values[10] = math.nan
    values[900] = math.inf
    keep = downsample_min_max(values, 8)
    assert 10 in keep and 900 in keep


@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32), min_size=0, max_size=400),
       st.integers(min_value=2, max_value=50))
def test_bounded_ordered_and_keeps_global_extremes(values: list[float], max_points: int) -> None:
    keep = downsample_min_max(values, max_points)
    assert len(keep) <= max_points
    assert keep == sorted(set(keep))
    if values:
        kept = [values[i] for i in keep]
        assert max(kept) == max(values) and min(kept) == min(values)


def test_cursor_round_trip_and_rejection() -> None:
    from datetime import UTC, datetime

    when = datetime(2026, 1, 1, 12, 0, 0, 123456, tzinfo=UTC)
    assert _decode_cursor(_encode_cursor(when.isoformat(), 42), (datetime, int)) == [when, 42]
    assert _decode_cursor(_encode_cursor(7), (int,)) == [7]
    for bad in ["", "!!!", _encode_cursor("x"), _encode_cursor(1, 2), _encode_cursor(-1), _encode_cursor(True),
                _encode_cursor(2**64)]:
        with pytest.raises(BadCursor):
            _decode_cursor(bad, (int,))
    with pytest.raises(BadCursor):
        _decode_cursor(_encode_cursor("not-a-date", 1), (datetime, int))
