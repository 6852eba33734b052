"""Small helpers for end-to-end tests: request bodies, SSE parsing, ledger rows."""

from __future__ import annotations

import asyncio
import itertools
import json
import re
import time
from typing import Any

import httpx
from httpx_sse import EventSource, ServerSentEvent
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from service.stream.ids import Cursor
from tests.waiting import wait_until

# ~300 tokens with multi-byte characters, split characters and emoji
LONG = "Café crème costs 5€ in Zürich; 日本語のテキストも少し。 Emoji: 🤖🚀👩‍👩‍👧. " + " ".join(
    f"Line {i}: the quick brown fox jumps over the lazy dog." for i in range(10)
)


def chat_body(model: str, content: str, **extra: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def content_of(events: list[ServerSentEvent]) -> str:
    out = []
    for e in events:
        if not e.data or e.data == "[DONE]":
            continue
        payload = json.loads(e.data)
        for choice in payload.get("choices", []):
            delta = choice.get("delta") or {}
            out.append(delta.get("content") or choice.get("text") or "")
    return "".join(out)


def finish_reason(events: list[ServerSentEvent]) -> str | None:
    for e in events:
        if e.data and e.data != "[DONE]":
            for choice in json.loads(e.data).get("choices", []):
                if choice.get("finish_reason"):
                    return str(choice["finish_reason"])
    return None


def assert_ids_increase(events: list[ServerSentEvent]) -> None:
    cursors = [Cursor.parse(e.id) for e in events if e.id]
    assert all(a < b for a, b in itertools.pairwise(cursors)), [str(c) for c in cursors]


def read_all(
    client: httpx.Client, method: str, url: str, **kw: Any
) -> tuple[httpx.Headers, list[ServerSentEvent]]:
    with client.stream(method, url, **kw) as r:
        assert r.status_code == 200, r.read()
        return r.headers, list(EventSource(r).iter_sse())


def raw_events(client: httpx.Client, method: str, url: str, **kw: Any) -> tuple[str, bytes]:
    """The response bytes with keepalive comments removed."""
    with client.stream(method, url, **kw) as r:
        body = b"".join(r.iter_bytes())
        rid = r.headers["x-request-id"]
    return rid, re.sub(rb"^:[^\n]*\n", b"", body, flags=re.M)


def ledger_row(
    database_url: str, request_id: str, timeout_s: float = 15.0
) -> dict[str, Any] | None:
    async def fetch() -> dict[str, Any] | None:
        engine = create_async_engine(database_url)
        try:
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline:
                async with engine.connect() as conn:
                    row = (
                        (
                            await conn.execute(
                                text("SELECT * FROM requests WHERE id = :id"), {"id": request_id}
                            )
                        )
                        .mappings()
                        .first()
                    )
                if row is not None:
                    return dict(row)
                await asyncio.sleep(0.1)
            return None
        finally:
            await engine.dispose()

    return asyncio.run(fetch())


def tool_calls_of(chunks: list[Any]) -> tuple[str, dict[int, dict[str, str]], list[str]]:
    """The content, the calls (by index: id, name, joined arguments) and the finish
    reasons of choice 0 in an openai SDK chunk stream; a call's id must come once."""
    content, calls, finishes = "", {}, []
    for c in chunks:
        if not c.choices:
            continue
        choice = c.choices[0]
        content += choice.delta.content or ""
        for tc in choice.delta.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
            if tc.id:
                assert not call["id"], "a call's id comes once, in its first piece"
                call["id"] = tc.id
            if tc.function and tc.function.name:
                call["name"] = tc.function.name
            if tc.function and tc.function.arguments:
                call["arguments"] += tc.function.arguments
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
    return content, calls, finishes


def wait_state(url: str, rid: str, states: set[str], timeout_s: float = 60.0) -> dict[str, Any]:
    """The request's status once it is in one of ``states`` (the timeout: a safety net)."""
    last: dict[str, Any] = {}

    def reached() -> dict[str, Any] | None:
        last.update(httpx.get(f"{url}/v1/requests/{rid}", timeout=30).json())
        return dict(last) if last["state"] in states else None

    try:
        return wait_until(reached, f"{rid} to reach {states}", timeout=timeout_s, interval=0.02)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: {last}") from None


def read_some(
    url: str, payload: dict[str, Any], n: int, path: str = "/v1/chat/completions"
) -> tuple[str, list[Any], float]:
    """Open a stream, read ``n`` events, drop the connection. Also returns the wall-clock
    time taken just before the connection closed: the reader left after it."""
    seen = []
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", url + path, json=payload) as r,
    ):
        rid = r.headers["x-request-id"]
        for event in EventSource(r).iter_sse():
            seen.append(event)
            if len(seen) == n:
                break
        leaving_at = time.time()
    return rid, seen, leaving_at
