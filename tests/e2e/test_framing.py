"""OpenAI's literal framing, negotiated per request (``X-SSE-Framing: openai`` or
``?sse_framing=openai``): only ``data:`` lines (and ``event:`` on a Responses stream),
the position inside each chunk's JSON, and a resume from it that loses and repeats
nothing."""

from __future__ import annotations

import json
import uuid
from typing import Any

import httpx
import pytest
from openai import OpenAI

from tests.e2e.conftest import Stack
from tests.e2e.helpers import LONG, chat_body, raw_events, read_all
from tests.literal_sse import literal_messages

OPENAI = {"X-SSE-Framing": "openai"}


@pytest.fixture
def client(stack: Stack) -> httpx.Client:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        yield c


def text_of(chunks: list[Any]) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks
        if isinstance(c, dict) and c.get("choices")
    )


def test_a_chat_stream_reads_literally_and_matches_its_resumable_twin(
    stack: Stack, client: httpx.Client
) -> None:
    body = chat_body(stack.model, LONG, stream=True, stream_options={"include_usage": True})
    rid, raw = raw_events(client, "POST", "/v1/chat/completions", json=body, headers=OPENAI)
    assert b"\nid:" not in raw and not raw.startswith(b"retry:") and b"\nretry:" not in raw
    chunks = literal_messages(raw)
    assert chunks[-1] == "[DONE]" and text_of(chunks) == LONG
    assert chunks[-2]["usage"]["completion_tokens"] > 0
    # the same events as the resumable framing gives them, each with its id inside
    _, twin = read_all(client, "GET", f"/v1/requests/{rid}/events")
    assert [(c.pop("event_id"), c) for c in chunks[:-1]] == [
        (e.id, json.loads(e.data)) for e in twin[:-1]
    ]


def test_a_resume_from_the_id_inside_the_chunk_gets_exactly_the_rest(
    stack: Stack, client: httpx.Client
) -> None:
    body = chat_body(stack.model, LONG, stream=True)
    rid, raw = raw_events(client, "POST", "/v1/chat/completions", json=body, headers=OPENAI)
    chunks = literal_messages(raw)[:-1]
    for cut in (1, len(chunks) // 2, len(chunks) - 1):
        after = chunks[cut - 1]["event_id"]
        with client.stream(
            "GET", f"/v1/requests/{rid}/events", params={"sse_framing": "openai", "after": after}
        ) as r:
            rest = literal_messages(r.read())
        assert rest[-1] == "[DONE]"
        assert rest[:-1] == chunks[cut:]  # nothing lost, nothing repeated


def test_the_openai_sdk_reads_either_framing(stack: Stack) -> None:
    sdk = OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)
    for headers in ({}, OPENAI):
        stream = sdk.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": LONG}],
            stream=True,
            extra_headers=headers,
        )
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == LONG


def test_a_responses_stream_keeps_event_names_and_sequence_numbers(
    stack: Stack, client: httpx.Client
) -> None:
    body = {"model": stack.model, "input": LONG, "stream": True}
    rid, raw = raw_events(client, "POST", "/v1/responses", json=body, headers=OPENAI)
    assert b"\nid:" not in raw and b"retry:" not in raw
    messages = [m for m in raw.decode().split("\n\n") if m.strip()]
    events = literal_messages(raw)
    assert [m.split("\n")[0] for m in messages] == [f"event: {e['type']}" for e in events]
    numbers = [e["sequence_number"] for e in events]
    assert numbers == list(range(len(events)))
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == LONG and events[-1]["type"] == "response.completed"
    with client.stream(
        "GET",
        f"/v1/responses/{rid}",
        params={"stream": "true", "starting_after": 3, "sse_framing": "openai"},
    ) as r:
        assert literal_messages(r.read()) == events[4:]


def test_an_unknown_framing_is_a_400_naming_the_choices(stack: Stack, client: httpx.Client) -> None:
    key = {"Idempotency-Key": f"framing-{uuid.uuid4().hex}"}
    r = client.post(
        "/v1/chat/completions",
        json=chat_body(stack.model, "hi", stream=True),
        headers={"X-SSE-Framing": "literal", **key},
    )
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "X-SSE-Framing" and "openai or resumable" in error["message"]
    # refused before anything was made: the key is free for another body (else a 422)
    r = client.post("/v1/chat/completions", json=chat_body(stack.model, "other"), headers=key)
    assert r.status_code == 200, r.text
