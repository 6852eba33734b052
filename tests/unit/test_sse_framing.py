"""The two SSE framings: ``openai`` reads back through a literal parser (every message
``data: <json>``) with the position inside the JSON; ``resumable`` carries it as ``id:``."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from service.stream import sse
from tests.literal_sse import literal_messages

text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=40)
chunks = st.dictionaries(st.sampled_from(["id", "object", "content", "x"]), text, min_size=1)
event_ids = st.builds(
    lambda ms, seq, k: f"{ms}-{seq}" + ("" if k is None else f":{k}"),
    st.integers(0, 2**48),
    st.integers(0, 2**20),
    st.none() | st.integers(0, 5),
)


def encode(chunk: dict[str, Any]) -> bytes:
    return json.dumps(chunk, ensure_ascii=False, separators=(",", ":")).encode()


@given(st.lists(st.tuples(chunks, event_ids), max_size=6), st.booleans())
def test_openai_framing_reads_literally_with_the_position_inside(
    stream: list[tuple[dict[str, Any], str]], pings: bool
) -> None:
    framing = sse.OPENAI
    body = framing.opening(1000)
    for chunk, eid in stream:
        if pings:  # a ping before every chunk: each must stay a message of its own
            body += framing.keepalive()
        body += framing.chunk(sse.escape_json(encode(chunk)), eid)
    body += framing.chunk(sse.DONE, "9-9") + framing.reconnect(250)
    assert b"\nid:" not in body and b"retry:" not in body
    got = literal_messages(body)
    assert got[-1] == "[DONE]"
    assert got[:-1] == [{"event_id": eid, **chunk} for chunk, eid in stream]


@given(chunks, event_ids)
def test_resumable_framing_carries_the_position_as_its_id(chunk: dict[str, Any], eid: str) -> None:
    frame = sse.RESUMABLE.chunk(encode(chunk), eid)
    lines = frame.decode().split("\n")
    assert lines[-3] == f"id: {eid}" and lines[-2:] == ["", ""]
    assert json.loads(lines[0].removeprefix("data: ")) == chunk
    assert sse.RESUMABLE.opening(1000) == b"retry: 1000\n"


def test_responses_events_keep_their_names_and_lose_only_the_id() -> None:
    data = b'{"type":"response.created","sequence_number":0}'
    assert sse.OPENAI.event(data, 0, "response.created") == (
        b"event: response.created\ndata: " + data + b"\n\n"
    )
    assert sse.RESUMABLE.event(data, 0, "response.created").endswith(b"\nid: 0\n\n")
