"""Event ids and SSE cursors."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.stream.ids import Cursor, EventId, InvalidEventId, frame_ids, frames_to_skip

u64 = st.integers(min_value=0, max_value=2**64 - 1)
cursors = st.builds(
    Cursor, st.builds(EventId, u64, u64), st.one_of(st.none(), st.integers(0, 9999))
)


@given(cursors)
def test_cursor_round_trips(c: Cursor) -> None:
    assert Cursor.parse(str(c)) == c


@given(cursors, cursors)
def test_cursor_order_is_event_then_frame_whole_last(a: Cursor, b: Cursor) -> None:
    if a.event != b.event:
        assert (a < b) == (a.event < b.event)
    elif a.frame is None and b.frame is not None:
        assert b < a


@pytest.mark.parametrize(
    "raw",
    [
        "",
        "abc",
        "1-",
        "-1",
        "1-2-3",
        "1-2:",
        "1-2:x",
        "1 -2",
        "1-2\nid: 9-9",
        "99999999999999999999999-1",
        "18446744073709551616-0",
        "1-2:99999",
        "\uff11-\uff12",  # full-width digits: not ASCII, must be refused
    ],
)
def test_malformed_cursor_rejected(raw: str) -> None:
    with pytest.raises(InvalidEventId):
        Cursor.parse(raw)


def test_frame_ids_and_skip() -> None:
    e = EventId(5, 1)
    ids = frame_ids(e, 3)
    assert [str(i) for i in ids] == ["5-1:0", "5-1:1", "5-1"]
    assert ids[0] < ids[1] < ids[2] < Cursor(EventId(5, 2))
    assert frames_to_skip(None, e) == 0
    assert frames_to_skip(Cursor(EventId(5, 0)), e) == 0
    assert frames_to_skip(ids[0], e) == 1
    assert frames_to_skip(ids[1], e) == 2
    assert frames_to_skip(ids[2], e) is None
    assert frames_to_skip(Cursor(EventId(6, 0)), e) is None


@given(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1))
def test_from_redis_agrees_with_parse(ms: int, seq: int) -> None:
    raw = f"{ms}-{seq}"
    assert EventId.from_redis(raw.encode()) == EventId.from_redis(raw) == EventId.parse(raw)
