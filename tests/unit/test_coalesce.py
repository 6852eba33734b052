"""Coalescing for readers that fell behind: same text, fewer events, valid cursors."""

from __future__ import annotations

import itertools
import json

import httpx
from httpx_sse import EventSource
from hypothesis import given
from hypothesis import strategies as st

from service.stream import sse
from service.stream.events import Created, Delta, End, Event
from service.stream.ids import Cursor, EventId
from service.stream.render import ChunkRenderer, coalesce, sse_event_frames

events = st.lists(
    st.one_of(
        st.builds(lambda t: Delta(text=t, token_ids=[1], n=0), st.text(max_size=4)),
        st.just(End(state="finished", finish_reason="stop", prompt_tokens=1, completion_tokens=1)),
    ),
    max_size=20,
)


def numbered(evs: list[Event]) -> list[tuple[EventId, Event]]:
    return [(EventId(1000 + i, 0), e) for i, e in enumerate(evs)]


def render(
    batch: list[tuple[EventId, Event]], cursor: Cursor | None = None
) -> list[tuple[str, str]]:
    r = ChunkRenderer("r", Created(kind="chat", model="m", created=1, prompt_tokens=1))
    body = b"".join(b"".join(sse_event_frames(r, i, e, cursor)) for i, e in batch)
    resp = httpx.Response(200, headers={"content-type": sse.MEDIA_TYPE}, content=body)
    return [(e.id, e.data) for e in EventSource(resp).iter_sse()]


def text(frames: list[tuple[str, str]]) -> str:
    out = []
    for _id, data in frames:
        if data != "[DONE]":
            for c in json.loads(data)["choices"]:
                out.append(c["delta"].get("content") or "")
    return "".join(out)


@given(events)
def test_coalesced_stream_says_the_same_with_fewer_events(evs: list[Event]) -> None:
    batch = numbered(evs)
    merged = coalesce(batch)
    assert len(merged) <= len(batch)
    assert not any(
        isinstance(a[1], Delta) and isinstance(b[1], Delta) for a, b in itertools.pairwise(merged)
    )
    assert text(render(merged)) == text(render(batch))
    # every id a coalesced reader saw is a cursor that resumes the canonical stream exactly
    for frame_id, _data in render(merged):
        cursor = Cursor.parse(frame_id)
        full = render(batch)
        seen = [f for f in full if Cursor.parse(f[0]).sort_key <= cursor.sort_key]
        assert text(seen) + text(render(batch, cursor)) == text(full)
