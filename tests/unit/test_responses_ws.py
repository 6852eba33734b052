"""The Responses WebSocket mode's protocol without I/O (``stream/responses_ws.py``): client
messages, the resume cursor, events with their lane, OpenAI's error shapes; and the gate
on a WebSocket handshake."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from openai.types.responses.responses_server_event import ResponseWsError

from service.api.gate import Gate, Hosts
from service.stream import responses_ws as ws


def test_a_create_is_a_streaming_post_body_and_its_lane() -> None:
    msg = ws.parse(
        json.dumps({"type": "response.create", "model": "m", "input": "hi", "stream_id": "a"})
    )
    assert msg == ws.Create({"model": "m", "input": "hi", "stream": True}, "a")
    keyed = ws.parse('{"type": "response.create", "model": "m", "idempotency_key": "k-1"}')
    assert keyed == ws.Create({"model": "m", "stream": True}, None, "k-1")
    plain = ws.parse(
        b'{"type": "response.create", "model": "m", "stream": true, "background": false}'
    )
    assert plain == ws.Create({"model": "m", "stream": True}, None)


@pytest.mark.parametrize(
    ("text", "param", "code"),
    [
        ("{nope", None, "invalid_json"),
        ("[1, 2]", None, "invalid_json"),
        ('{"type": "session.update"}', "type", "invalid_event_type"),
        ('{"model": "m"}', "type", "invalid_event_type"),
        ('{"type": "response.create", "background": true}', "background", "invalid_request"),
        ('{"type": "response.create", "stream": false}', "stream", "invalid_request"),
        ('{"type": "response.create", "stream_id": 7}', "stream_id", "invalid_request"),
        ('{"type": "response.create", "stream_id": ""}', "stream_id", "invalid_request"),
        (
            '{"type": "response.create", "idempotency_key": "a b"}',
            "idempotency_key",
            "invalid_idempotency_key",
        ),
    ],
)
def test_what_the_server_cannot_act_on(text: str, param: str | None, code: str) -> None:
    with pytest.raises(ws.ProtocolError) as refused:
        ws.parse(text)
    assert (refused.value.param, refused.value.code) == (param, code)
    event = json.loads(ws.protocol_error(refused.value, "lane"))
    assert event["status"] == 400 and event["stream_id"] == "lane"
    ResponseWsError.model_validate(event)  # OpenAI's shape


def test_a_steer_is_refused_with_its_input_back() -> None:
    msg = ws.parse('{"type": "response.steer", "input": "go on", "previous_response_id": "resp_1"}')
    assert isinstance(msg, ws.Steer)
    failed = json.loads(ws.steer_failed(msg))
    assert failed["type"] == "response.steer.failed"
    assert failed["error"]["code"] == "steering_not_supported"
    assert failed["steer"] == {"input": "go on", "previous_response_id": "resp_1"}


LANE = st.text(st.characters(blacklist_characters=",", blacklist_categories=("Cs",)), min_size=1)


@given(
    st.lists(
        st.tuples(st.uuids(), st.one_of(st.none(), st.integers(0, 10**17)), st.none() | LANE),
        max_size=5,
        unique_by=lambda t: t[0],
    )
)
def test_the_resume_cursor_round_trips(entries: list[tuple[Any, int | None, str | None]]) -> None:
    def entry(rid: str, after: int | None, lane: str | None) -> str:
        return f"{rid}:{'' if after is None else after}" + ("" if lane is None else f":{lane}")

    wanted = [ws.Resume(f"resp_{u.hex}", after, lane) for u, after, lane in entries]
    text = ",".join(entry(r.response_id, r.after, r.stream_id) for r in wanted)
    assert ws.parse_resume([text]) == wanted
    assert ws.parse_resume([entry(r.response_id, r.after, r.stream_id) for r in wanted]) == wanted


@pytest.mark.parametrize(
    "bad", ["chat_1:3", "resp_1:x", "resp_1:-1", "resp_1:²", "resp_1:1,resp_1:2"]
)
def test_a_malformed_cursor_is_refused(bad: str) -> None:
    with pytest.raises(ws.ProtocolError):
        ws.parse_resume([bad])


def test_an_event_carries_its_lane_after_the_same_bytes() -> None:
    data = b'{"type":"response.output_text.delta","sequence_number":4,"delta":"\\u2028"}'
    assert ws.event(data, None) == data.decode()
    tagged = ws.event(data, 'a "lane"')
    assert tagged.startswith(data[:-1].decode()) and json.loads(tagged)["stream_id"] == 'a "lane"'
    chunk = b"retry: 1000\nevent: x\ndata: " + data + b"\nid: 4\n\n: ping\n"
    assert ws.sse_data(chunk) == [data]


def test_a_missing_previous_response_is_openais_error() -> None:
    body = {
        "error": {
            "message": "no response 'resp_x'",
            "type": "not_found_error",
            "param": "previous_response_id",
            "code": "not_found",
        }
    }
    event = json.loads(ws.refused(404, body, {}, None))
    assert event["status"] == 400 and event["error"]["code"] == "previous_response_not_found"
    busy = json.loads(
        ws.refused(429, {"error": {**body["error"], "param": None}}, {"Retry-After": "1"}, "b")
    )
    assert busy["error"]["headers"] == {"retry-after": "1"} and busy["stream_id"] == "b"
    ResponseWsError.model_validate(busy)


def test_the_gate_refuses_a_handshake_from_another_host_with_its_http_answer() -> None:
    reached: list[str] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        reached.append(scope["type"])

    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    gate = Gate(app, Hosts.parse("localhost"), max_in_flight=10)
    scope = {"type": "websocket", "path": "/v1/responses", "headers": [(b"host", b"evil.example")]}
    asyncio.run(gate(scope, receive, send))
    assert reached == [] and sent[0]["type"] == "websocket.http.response.start"
    assert sent[0]["status"] == 400 and b"host_not_allowed" in sent[1]["body"]
    asyncio.run(gate({**scope, "headers": [(b"host", b"localhost:8000")]}, receive, send))
    assert reached == ["websocket"]
