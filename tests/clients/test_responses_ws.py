"""The Responses WebSocket mode through both official SDKs' own ``connect()`` with their
own reconnection, through a proxy that cuts every connection: two responses on two lanes,
and on every reconnect the SDK's ``on_reconnecting`` hook names what it has of each
response in flight (``resume=<response id>:<last sequence number>:<lane>``). Every answer
comes whole, each event once, equal to its HTTP twin.

The proxy lets each connection carry at least 6,000 bytes: the first one then always
delivers both ``response.created`` events, without which a client cannot name a response
(a limit of the mode, in docs/reference/responses-websocket.md)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import OpenAI
from openai.types.websocket_reconnection import ReconnectingEvent, ReconnectingOverrides

from tests.clients.conftest import QUESTION, ClientStack, api_target
from tests.clients.proxy import CuttingProxy

pytestmark = [
    pytest.mark.clients,
    pytest.mark.timeout(300),
    # openai 3.60 calls websockets 17's connect() without a ``with``: a DeprecationWarning
    pytest.mark.filterwarnings(
        "ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"
    ),
]
TERMINAL = {"response.completed", "response.failed", "response.incomplete"}
QUESTIONS = {"a": QUESTION, "b": QUESTION[:200]}
MIN_BYTES = 6000  # two response.created events and then some


@pytest.fixture
def cutting(clients_stack: ClientStack) -> Iterator[CuttingProxy]:
    p = CuttingProxy(api_target(clients_stack), min_bytes=MIN_BYTES, max_bytes=12_000)
    p.start()
    try:
        yield p
    finally:
        p.close()


def twin(stack: ClientStack, api_key: str, rid: str) -> list[bytes]:
    """The response's HTTP stream read straight from the API: each SSE event's data."""
    got = httpx.get(
        f"{stack.url}/v1/responses/{rid}",
        params={"stream": "true"},
        headers={"Authorization": f"Bearer {api_key}"},
        timeout=60,
    )
    assert got.status_code == 200, got.text
    return [line[6:] for line in got.content.split(b"\n") if line.startswith(b"data: ")]


def on_lane(data: bytes, lane: str) -> bytes:
    return data[:-1] + b',"stream_id":' + json.dumps(lane).encode() + b"}"


def by_lane(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    lanes: dict[str, list[dict[str, Any]]] = {lane: [] for lane in QUESTIONS}
    for event in events:
        lanes[event["stream_id"]].append(event)
    return lanes


def check(lanes: dict[str, list[dict[str, Any]]], stack: ClientStack, api_key: str) -> None:
    """Each lane's events are its response's HTTP twin's, each once, in order."""
    for lane, got in lanes.items():
        numbers = [e["sequence_number"] for e in got]
        assert numbers == list(range(len(got))), numbers  # none lost or twice
        assert got[-1]["type"] == "response.completed", got[-1]
        text = "".join(e["delta"] for e in got if e["type"] == "response.output_text.delta")
        assert text == QUESTIONS[lane]
        whole = twin(stack, api_key, got[0]["response"]["id"])
        assert got == [json.loads(on_lane(d, lane)) for d in whole]


def test_python_sdk_reconnects_and_resumes_every_response(
    clients_stack: ClientStack, api_key: str, cutting: CuttingProxy
) -> None:
    client = OpenAI(base_url=cutting.url + "/v1", api_key=api_key, max_retries=0)
    reconnects = 0
    # the recipe of docs/reference/responses-websocket.md, as it is printed there
    current, seen = {}, {}  # lane -> response id; response id -> (last sequence number, lane)

    def on_reconnecting(event: ReconnectingEvent) -> ReconnectingOverrides:
        nonlocal reconnects
        reconnects += 1
        cursors = [f"{rid}:{n}" + (f":{lane}" if lane else "") for rid, (n, lane) in seen.items()]
        return {"extra_query": {"resume": ",".join(cursors)} if cursors else {}}

    got: list[dict[str, Any]] = []
    ended = 0
    with client.responses.connect(
        on_reconnecting=on_reconnecting, max_retries=50, initial_delay=0.05, max_delay=0.2
    ) as conn:
        for lane, question in QUESTIONS.items():
            conn.response.create(model=clients_stack.model, input=question, stream_id=lane)
        for event in conn:  # the SDK's iterator reconnects (1006, 1011, 1012, ...)
            lane = getattr(event, "stream_id", None)
            if event.type == "response.created":
                current[lane] = event.response.id
            if lane in current and getattr(event, "sequence_number", None) is not None:
                seen[current[lane]] = (event.sequence_number, lane)
            if event.type in ("response.completed", "response.incomplete", "response.failed"):
                seen.pop(current.pop(lane), None)
            got.append(event.to_dict())  # (the test's own bookkeeping from here)
            ended += event.type in TERMINAL
            if ended == len(QUESTIONS):
                break
    check(by_lane(got), clients_stack, api_key)
    print(f"CLIENT-STATS python responses ws: reconnects={reconnects} cuts={cutting.cuts}")
    assert reconnects >= 1 and cutting.cuts >= 1


def test_node_sdk_reconnects_and_resumes_every_response(
    node: Any, clients_stack: ClientStack, api_key: str, cutting: CuttingProxy
) -> None:
    env = {
        "LASTEVENT_URL": cutting.url,
        "LASTEVENT_API_KEY": api_key,
        "LASTEVENT_MODEL": clients_stack.model,
        "QUESTION": QUESTIONS["a"],
        "QUESTION_B": QUESTIONS["b"],
    }
    out = node("node/openai_responses_ws.mjs", env=env, timeout=240).result()
    assert out["error"] is None, out["errors"]
    check(by_lane(out["events"]), clients_stack, api_key)
    print(f"CLIENT-STATS node responses ws: reconnects={out['reconnects']} cuts={cutting.cuts}")
    assert out["reconnects"] >= 1 and cutting.cuts >= 1
