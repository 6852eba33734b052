"""SSE framing, parsed back by an independent parser (httpx-sse)."""

from __future__ import annotations

import json

import httpx
from httpx_sse import EventSource
from hypothesis import given, settings
from hypothesis import strategies as st

from service.stream import sse
from service.stream.events import Created, Delta, End, Kind
from service.stream.ids import EventId, frame_ids
from service.stream.render import ChunkRenderer

HOSTILE = [
    "\n",
    "\r",
    "\r\n",
    "\n\n",
    "data: ",
    "id: 1-1",
    "event: x",
    "\x00",
    "\u2028",
    "\u2029",
    "\x85",
    ":",
    "retry: 1",
    "\ufeff",
    "é",
    "日本語",
    "🤖",
]
hostile_text = st.lists(st.one_of(st.sampled_from(HOSTILE), st.text(max_size=5)), max_size=12).map(
    "".join
)


def parse(body: bytes) -> list[tuple[str, str]]:
    response = httpx.Response(200, headers={"content-type": sse.MEDIA_TYPE}, content=body)
    return [(e.id, e.data) for e in EventSource(response).iter_sse()]


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(hostile_text, min_size=1, max_size=8), chat=st.booleans())
def test_model_output_cannot_create_or_split_events(texts: list[str], chat: bool) -> None:
    created = Created(kind=Kind.CHAT if chat else Kind.TEXT, model="m", created=1, prompt_tokens=3)
    r = ChunkRenderer("req-1", created)
    body = b""
    expected_ids = []
    for i, text in enumerate(texts):
        eid = EventId(1000 + i, 0)
        [payload] = r.render(Delta(text=text, token_ids=[1], n=i + 1))
        body += sse.frame(payload, str(frame_ids(eid, 1)[0]))
        expected_ids.append(str(eid))
    events = parse(body)
    assert [e[0] for e in events] == expected_ids
    got = []
    for _id, data in events:
        choice = json.loads(data)["choices"][0]
        got.append(choice["delta"]["content"] if chat else choice["text"])
    assert got == texts


def test_id_field_cannot_inject() -> None:
    body = sse.frame(b'{"a":1}', "1-1\r\ndata: forged\n\nid: 2-2") + sse.frame(b"[DONE]", "3-3")
    events = parse(body)
    assert len(events) == 2
    assert "\n" not in events[0][0] and "\r" not in events[0][0]
    assert events[0][1] == '{"a":1}'


def test_escape_keeps_json_valid() -> None:
    raw = json.dumps({"t": "a\u2028b\u2029c\x85d"}, ensure_ascii=False).encode()
    escaped = sse.escape_json(raw)
    assert b"\xe2\x80\xa8" not in escaped and b"\xc2\x85" not in escaped
    assert json.loads(escaped) == {"t": "a\u2028b\u2029c\x85d"}


def test_end_renders_final_usage_and_done() -> None:
    created = Created(kind=Kind.CHAT, model="m", created=1, prompt_tokens=3, include_usage=True)
    frames = ChunkRenderer("r", created).render(
        End(state="finished", finish_reason="stop", prompt_tokens=3, completion_tokens=4)
    )
    assert frames[-1] == sse.DONE
    assert json.loads(frames[0])["choices"][0]["finish_reason"] == "stop"
    assert json.loads(frames[1])["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 4,
        "total_tokens": 7,
    }


def test_errored_end_has_no_done() -> None:
    created = Created(kind=Kind.CHAT, model="m", created=1, prompt_tokens=3)
    frames = ChunkRenderer("r", created).render(
        End(state="errored", finish_reason=None, prompt_tokens=3, completion_tokens=1)
    )
    assert frames == []


def test_keepalive_between_events_is_invisible_to_the_openai_sdk() -> None:
    """The SDK dispatches an empty event on a blank line once it has seen an id."""
    from openai._streaming import SSEDecoder

    body = (
        sse.frame(b'{"a":1}', "1-0")
        + sse.KEEPALIVE
        + sse.KEEPALIVE
        + sse.frame(b'{"b":2}', "2-0")
        + sse.KEEPALIVE
        + sse.frame(sse.DONE, "3-0")
    )
    events = list(SSEDecoder().iter_bytes(iter([body[i : i + 7] for i in range(0, len(body), 7)])))
    assert [e.data for e in events] == ['{"a":1}', '{"b":2}', "[DONE]"]
    assert [d for _, d in parse(body)] == ['{"a":1}', '{"b":2}', "[DONE]"]
