"""One resumable stream end to end: real API and worker processes, real Redis and Postgres."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from httpx_sse import EventSource, aconnect_sse

from service.stream.ids import Cursor
from service.tokenize import ModelInfo
from tests.e2e.conftest import Stack
from tests.e2e.helpers import (
    LONG,
    assert_ids_increase,
    chat_body,
    content_of,
    finish_reason,
    ledger_row,
    raw_events,
    read_all,
)


@pytest.fixture
def client(stack: Stack) -> httpx.Client:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        yield c


def test_uninterrupted_stream(stack: Stack, client: httpx.Client) -> None:
    headers, events = read_all(
        client,
        "POST",
        "/v1/chat/completions",
        json=chat_body(stack.model, LONG, stream=True, stream_options={"include_usage": True}),
    )
    assert headers["content-type"].startswith("text/event-stream")
    assert headers["cache-control"] == "no-cache"
    assert headers["x-accel-buffering"] == "no"
    rid = headers["x-request-id"]
    assert content_of(events) == LONG
    assert finish_reason(events) == "stop"
    assert events[-1].data == "[DONE]"
    first = json.loads(events[0].data)
    assert first["id"] == rid and first["choices"][0]["delta"]["role"] == "assistant"
    assert all(json.loads(e.data)["id"] == rid for e in events[:-1])
    assert_ids_increase(events)
    usage = json.loads(events[-2].data)["usage"]
    row = ledger_row(stack.settings.database_url or "", rid)
    assert row is not None
    assert row["state"] == "finished" and row["finish_reason"] == "stop"
    assert (row["prompt_tokens"], row["completion_tokens"], row["total_tokens"]) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
        usage["total_tokens"],
    )
    assert row["last_event_id"] == events[-1].id
    assert row["first_token_at"] is not None


@pytest.mark.parametrize("drop_after", [1, 7, 40])
def test_drop_and_resume_with_last_event_id(
    stack: Stack, client: httpx.Client, drop_after: int
) -> None:
    body = chat_body(stack.model, LONG, stream=True, stream_options={"include_usage": True})
    seen = []
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        rid = r.headers["x-request-id"]
        for event in EventSource(r).iter_sse():
            seen.append(event)
            if len(seen) == drop_after:
                break  # the connection is dropped mid-stream
    resumed = seen[-1].id
    _, rest = read_all(
        client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": resumed}
    )
    joined = seen + rest
    assert_ids_increase(joined)
    assert content_of(joined) == LONG
    assert joined[-1].data == "[DONE]"
    # and the same through ?after= (what a client without header control uses)
    _, again = read_all(client, "GET", f"/v1/requests/{rid}/events", params={"after": resumed})
    assert [(e.id, e.data) for e in again] == [(e.id, e.data) for e in rest]


def test_resume_inside_the_terminal_event_repeats_nothing(
    stack: Stack, client: httpx.Client
) -> None:
    body = chat_body(
        stack.model, "short answer", stream=True, stream_options={"include_usage": True}
    )
    _, events = read_all(client, "POST", "/v1/chat/completions", json=body)
    rid = json.loads(events[0].data)["id"]
    final_chunk = next(i for i, e in enumerate(events) if finish_reason([e]))
    assert Cursor.parse(events[final_chunk].id).frame == 0
    _, rest = read_all(
        client,
        "GET",
        f"/v1/requests/{rid}/events",
        headers={"Last-Event-ID": events[final_chunk].id},
    )
    assert [(e.id, e.data) for e in rest] == [(e.id, e.data) for e in events[final_chunk + 1 :]]
    # the client has it all: 204, the SSE standard's "stop reconnecting"
    done = client.get(f"/v1/requests/{rid}/events", headers={"Last-Event-ID": events[-1].id})
    assert done.status_code == 204 and done.content == b""
    assert done.headers["x-request-id"] == rid


def test_replay_is_byte_for_byte(stack: Stack, client: httpx.Client) -> None:
    body = chat_body(stack.model, LONG[:200], stream=True, stream_options={"include_usage": True})
    rid, live = raw_events(client, "POST", "/v1/chat/completions", json=body)
    rid2, replay = raw_events(client, "GET", f"/v1/requests/{rid}/events")
    assert rid2 == rid
    assert replay == live


async def test_second_reader_gets_the_same_events(stack: Stack) -> None:
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as client:
        body = chat_body(stack.model, LONG, stream=True)
        async with aconnect_sse(client, "POST", "/v1/chat/completions", json=body) as first:
            rid = first.response.headers["x-request-id"]

            async def second_reader() -> list[tuple[str, str]]:
                async with aconnect_sse(client, "GET", f"/v1/requests/{rid}/events") as second:
                    return [(e.id, e.data) async for e in second.aiter_sse()]

            other = asyncio.create_task(second_reader())
            mine = [(e.id, e.data) async for e in first.aiter_sse()]
        assert await other == mine
        assert len(mine) > 50


def test_status_route(stack: Stack, client: httpx.Client) -> None:
    _, events = read_all(
        client,
        "POST",
        "/v1/chat/completions",
        json=chat_body(stack.model, "hello status", stream=True),
    )
    rid = json.loads(events[0].data)["id"]
    status = client.get(f"/v1/requests/{rid}").json()
    assert status["state"] == "finished"
    assert status["finish_reason"] == "stop"
    assert status["last_event_id"] == events[-1].id
    assert status["usage"]["completion_tokens"] > 0


def test_max_tokens_and_stop_strings(stack: Stack, client: httpx.Client) -> None:
    _, events = read_all(
        client,
        "POST",
        "/v1/chat/completions",
        json=chat_body(stack.model, LONG, stream=True, max_tokens=5),
    )
    assert finish_reason(events) == "length"
    assert LONG.startswith(content_of(events)) and len(content_of(events)) < 40
    _, events = read_all(
        client,
        "POST",
        "/v1/chat/completions",
        json=chat_body(stack.model, LONG, stream=True, stop=["fox jumps", "日本"]),
    )
    assert finish_reason(events) == "stop"
    assert content_of(events) == LONG[: LONG.index("日本")]


def test_text_completions_stream(stack: Stack, client: httpx.Client) -> None:
    _, events = read_all(
        client,
        "POST",
        "/v1/completions",
        json={"model": stack.model, "prompt": "Zürich €5 🤖", "stream": True},
    )
    assert json.loads(events[0].data)["object"] == "text_completion"
    assert content_of(events) == "Zürich €5 🤖"
    assert events[-1].data == "[DONE]"


HOSTILE = [
    "\n",
    "\r",
    "\r\n",
    "\n\n",
    "data: ",
    "id: 1-1\n",
    "event: x",
    "\x00",
    "\u2028",
    "\u2029",
    "\x85",
    ": ping",
    "retry: 1",
    "[DONE]",
    "é",
    "€",
    "日本語",
    "🤖",
    "\ufffd",
]


def test_hostile_model_output_arrives_intact(
    stack: Stack, client: httpx.Client, model: ModelInfo
) -> None:
    """Model output full of SSE lookalikes and line breaks, through the real stack and an
    independent SSE parser, equals what the engine produced."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    pieces = st.one_of(
        st.sampled_from(HOSTILE), st.text(max_size=4).filter(lambda t: "<|" not in t)
    )

    @given(st.lists(pieces, min_size=1, max_size=12).map("".join).filter(str.strip))
    @settings(
        max_examples=20, deadline=None, database=None, suppress_health_check=list(HealthCheck)
    )
    def check(text: str) -> None:
        _, events = read_all(
            client, "POST", "/v1/chat/completions", json=chat_body(stack.model, text, stream=True)
        )
        # the engine's text: the echo through the tokenizer (which drops a few control
        # characters it cannot represent)
        assert content_of(events) == model.decode(model.encode(text))
        assert events[-1].data == "[DONE]"

    check()
