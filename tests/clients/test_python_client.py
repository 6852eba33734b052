"""clients/python (lastevent-client) against a real stack through a CuttingProxy: the exact
answer, after many broken connections, with nothing lost or repeated, and no connection
after the end. Plus the client's SSE handling on its own: any cut, anywhere, loses no
event and repeats none (hypothesis)."""

from __future__ import annotations

import asyncio
import collections
import json
import random
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource
from hypothesis import given, settings
from hypothesis import strategies as st
from lastevent_client import AsyncClient, Backoff, Client, LastEventError
from lastevent_client._core import StreamState, text_of
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from tests.clients.conftest import (
    QUESTION,
    RECONNECT_HINT_MS,
    ClientStack,
    api_target,
    make_key,
)
from tests.clients.proxy import CuttingProxy
from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import ledger_row

pytestmark = pytest.mark.clients

USER = [{"role": "user", "content": QUESTION}]
# the stack's `retry:` is the base; a test should not give up on a busy machine
PATIENT = Backoff(max_reconnects=20, max_delay_s=2.0)


def messages(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def _key(chunk: dict[str, Any]) -> str:
    return json.dumps(chunk, sort_keys=True)


def lost_and_repeated(got: list[dict[str, Any]], whole: list[dict[str, Any]]) -> tuple[int, int]:
    """Chunks of the uninterrupted stream missing from ``got``, and chunks ``got`` has
    more often than the uninterrupted stream."""
    g = collections.Counter(map(_key, got))
    w = collections.Counter(map(_key, whole))
    return sum((w - g).values()), sum((g - w).values())


def report(name: str, **figures: object) -> None:
    """One line per run for docs/clients.md (pytest -s shows them)."""
    print(f"CLIENT-STATS {json.dumps({'client': name, **figures})}")


def uninterrupted(stack: Stack, api_key: str, request_id: str) -> list[dict[str, Any]]:
    """The whole stream read again from the start, straight from the API."""
    with Client(stack.url, api_key) as direct:
        return list(direct.resume(request_id).chunks())


# ------------------------------------------------------------------ through the proxy


def test_sync_stream_resumes_exactly_through_cuts(
    clients_stack: ClientStack, api_key: str, proxy: CuttingProxy
) -> None:
    with Client(proxy.url, api_key, backoff=PATIENT) as client:
        stream = client.chat.stream(model=clients_stack.model, messages=USER)
        chunks = list(stream.chunks())
        at_end = proxy.connections
        assert "".join(text_of(c) for c in chunks) == QUESTION
        assert stream.finish_reason == "stop"
        assert stream.request_id and stream.last_event_id and stream.stream_token
        assert stream.reconnects > 0
        assert stream.retry_ms == RECONNECT_HINT_MS  # every stream starts with retry:
        assert proxy.cuts >= stream.reconnects
        # every connection the client made is one the proxy saw (a cut one is never reused)
        assert at_end == stream.reconnects + 1
        # the end is the end: reading on connects to nothing
        assert list(stream) == []
        assert next(iter(stream), None) is None
    assert proxy.connections == at_end
    lost, repeated = lost_and_repeated(chunks, uninterrupted(clients_stack, api_key, rid(stream)))
    assert (lost, repeated) == (0, 0)
    report("lastevent-client (sync)", reconnects=stream.reconnects, lost=lost, repeated=repeated)


def rid(stream: Any) -> str:
    assert stream.request_id is not None
    return str(stream.request_id)


def test_async_streams_resume_exactly_through_cuts(
    clients_stack: ClientStack, api_key: str, proxy: CuttingProxy
) -> None:
    questions = [f"{i}: {QUESTION}" for i in range(3)]

    async def main() -> list[tuple[str, Any, list[dict[str, Any]]]]:
        async with AsyncClient(proxy.url, api_key, backoff=PATIENT) as client:

            async def one(q: str) -> tuple[str, Any, list[dict[str, Any]]]:
                stream = client.chat.stream(model=clients_stack.model, messages=messages(q))
                chunks = [c async for c in stream.chunks()]
                return q, stream, chunks

            return await asyncio.gather(*(one(q) for q in questions))

    results = asyncio.run(main())
    at_end = proxy.connections
    assert at_end == sum(s.reconnects + 1 for _, s, _ in results)
    for q, stream, chunks in results:
        assert "".join(text_of(c) for c in chunks) == q
        assert stream.finish_reason == "stop"
        assert stream.reconnects > 0
        lost, repeated = lost_and_repeated(
            chunks, uninterrupted(clients_stack, api_key, rid(stream))
        )
        assert (lost, repeated) == (0, 0)
        report("lastevent-client (async)", reconnects=stream.reconnects, lost=lost, repeated=0)
    assert proxy.connections == at_end


def test_text_completions_resume_too(
    clients_stack: ClientStack, api_key: str, proxy: CuttingProxy
) -> None:
    prompt = QUESTION[:400]
    with Client(proxy.url, api_key, backoff=PATIENT) as client:
        stream = client.completions.stream(model=clients_stack.model, prompt=prompt)
        assert stream.text() == prompt  # the scripted engine echoes a text prompt
        assert stream.finish_reason == "stop"


def test_usage_chunk_is_waited_for(
    clients_stack: ClientStack, api_key: str, proxy: CuttingProxy
) -> None:
    """With include_usage the stream goes on past the finish chunk for the usage chunk."""
    with Client(proxy.url, api_key, backoff=PATIENT) as client:
        stream = client.chat.stream(
            model=clients_stack.model,
            messages=USER,
            stream_options={"include_usage": True},
        )
        assert stream.text() == QUESTION
        assert stream.usage is not None and stream.usage["completion_tokens"] > 0
        assert stream.done


def test_resume_later_with_the_stream_token_only(
    clients_stack: ClientStack, api_key: str, proxy: CuttingProxy
) -> None:
    """Read part of an answer, drop it, pick it up later from another client that has no
    API key: the X-Stream-Token authenticates the resume."""
    with Client(proxy.url, api_key, backoff=PATIENT) as client:
        stream = client.chat.stream(model=clients_stack.model, messages=USER)
        head = []
        for piece in stream:
            head.append(piece)
            if len(head) == 20:
                break
        stream.close()
        request_id, last, token = rid(stream), stream.last_event_id, stream.stream_token
    assert last is not None and token is not None
    with Client(proxy.url, backoff=PATIENT) as keyless:
        later = keyless.resume(request_id, last, token=token)
        assert "".join(head) + later.text() == QUESTION
        assert later.request_id == request_id
        assert keyless.status(request_id, token=token)["state"] == "finished"
        # nothing more: a resume at the terminal event is a 204, and no stream (asked
        # again only when the proxy cut the connection it asked on: its byte budget is per
        # connection, and the client's keep-alive connection carried the resume before)
        cuts = proxy.cuts
        after = keyless.resume(request_id, later.last_event_id, token=token)
        assert list(after) == [] and after.done
        assert after.reconnects == 0 or proxy.cuts > cuts, (after.reconnects, proxy.cuts)
        # without a token (and no key) the server does not know us
        with pytest.raises(LastEventError) as refused:
            keyless.resume(request_id, last).text()
        assert refused.value.status == 401


def test_cancel_stops_the_request_and_the_stream(
    clients_stack: ClientStack, api_key: str, proxy: CuttingProxy
) -> None:
    with Client(proxy.url, api_key, backoff=PATIENT) as client:
        stream = client.chat.stream(model=clients_stack.model, messages=USER)
        got = []
        for piece in stream:
            got.append(piece)
            if len(got) == 5:
                status = stream.cancel()
                assert status is not None and status["state"] in {"cancelled", "running"}
        assert len(got) == 5  # the iteration stopped at once
        assert client.status(rid(stream))["state"] == "cancelled"
        connections = proxy.connections
        assert list(stream) == []
        assert proxy.connections == connections


# ------------------------------------------------------------------------ idempotency


class Budgets:
    """The proxy's random budgets, the first ones given (a POST cut before its headers)."""

    def __init__(self, first: list[int]) -> None:
        self.first = list(first)
        self.rest = random.Random()

    def randint(self, a: int, b: int) -> int:
        return self.first.pop(0) if self.first else self.rest.randint(a, b)


@pytest.fixture
def early_cut(clients_stack: ClientStack) -> Iterator[CuttingProxy]:
    """Cuts the first response after 40 bytes: inside the status line and headers."""
    p = CuttingProxy(api_target(clients_stack))
    p._random = Budgets([40])  # type: ignore[assignment]
    p.start()
    try:
        yield p
    finally:
        p.close()


def requests_of(database_url: str, tenant: str) -> list[str]:
    async def fetch() -> list[str]:
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn:
                rows = await conn.execute(
                    text("SELECT id FROM requests WHERE tenant = :t"), {"t": tenant}
                )
                return [r[0] for r in rows]
        finally:
            await engine.dispose()

    return asyncio.run(fetch())


def test_post_cut_before_its_headers_is_sent_again_as_the_same_request(
    clients_stack: ClientStack, database_url: str, early_cut: CuttingProxy
) -> None:
    tenant = f"idem-{uuid.uuid4().hex[:8]}"
    key = make_key(database_url, tenant)
    with Client(early_cut.url, key, backoff=PATIENT) as client:
        stream = client.chat.stream(model=clients_stack.model, messages=USER)
        assert stream.text() == QUESTION
        assert stream.reconnects >= 1 and early_cut.cuts >= 1
    # both POSTs reached the server; one request came of them
    assert ledger_row(database_url, rid(stream)) is not None
    assert requests_of(database_url, tenant) == [rid(stream)]


def test_same_idempotency_key_same_request_other_body_422(
    clients_stack: ClientStack, api_key: str, proxy: CuttingProxy
) -> None:
    key = f"k-{uuid.uuid4().hex}"
    with Client(proxy.url, api_key, backoff=PATIENT) as client:
        first = client.chat.stream(model=clients_stack.model, messages=USER, idempotency_key=key)
        assert first.text() == QUESTION
        again = client.chat.stream(model=clients_stack.model, messages=USER, idempotency_key=key)
        assert again.text() == QUESTION  # the same request, from the start
        assert again.request_id == first.request_id
        assert again.idempotency_key == key
        other = client.chat.stream(
            model=clients_stack.model, messages=messages("another question"), idempotency_key=key
        )
        with pytest.raises(LastEventError) as reused:
            other.text()
    assert reused.value.status == 422
    assert reused.value.code == "idempotency_key_reused"


def test_post_again_at_the_terminal_event_is_204(clients_stack: ClientStack, api_key: str) -> None:
    """What an id-per-line client (fetch-event-source, POST mode) sends when a cut takes
    the id of [DONE] early: the same POST with Last-Event-ID at the terminal event."""
    key = f"k-{uuid.uuid4().hex}"
    body = {"model": clients_stack.model, "messages": USER, "stream": True}
    with Client(clients_stack.url, api_key) as client:
        first = client.chat.stream(model=clients_stack.model, messages=USER, idempotency_key=key)
        assert first.text() == QUESTION
    assert first.last_event_id is not None
    headers = {
        "Authorization": f"Bearer {api_key}",
        "Idempotency-Key": key,
        "Last-Event-ID": first.last_event_id,
    }
    with (
        httpx.Client(base_url=clients_stack.url, timeout=30) as c,
        c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r,
    ):
        assert r.headers.get("x-request-id") == first.request_id
        assert r.status_code == 204


# ---------------------------------------------------------------------- in-band errors


@pytest.fixture(scope="module")
def failing_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    """Its engine fails after 40 tokens: an error in band, after a stream has started."""
    with running(
        tmp_path_factory.mktemp("failing"),
        redis_url,
        database_url,
        model_dir,
        scripted_fail_after=40,
        scripted_tokens_per_s=100.0,
    ) as stack:
        yield stack


@pytest.fixture
def failing_proxy(failing_stack: Stack) -> Iterator[CuttingProxy]:
    p = CuttingProxy(api_target(failing_stack)).start()
    try:
        yield p
    finally:
        p.close()


def test_in_band_error_raises_last_event_error(
    failing_stack: Stack, failing_proxy: CuttingProxy
) -> None:
    with Client(failing_proxy.url, backoff=PATIENT) as client:
        stream = client.chat.stream(model=failing_stack.model, messages=USER)
        got: list[str] = []
        with pytest.raises(LastEventError) as failed:
            got.extend(stream)
        connections = failing_proxy.connections
        assert failed.value.code == "engine_failure"
        assert failed.value.request_id == stream.request_id
        assert QUESTION.startswith("".join(got)) and got  # the text before the error, exact
        assert list(stream) == []  # no reconnect after the error
    assert failing_proxy.connections == connections


def test_async_in_band_error(failing_stack: Stack, failing_proxy: CuttingProxy) -> None:
    async def main() -> LastEventError:
        async with AsyncClient(failing_proxy.url, backoff=PATIENT) as client:
            stream = client.chat.stream(model=failing_stack.model, messages=USER)
            with pytest.raises(LastEventError) as failed:
                async for _ in stream:
                    pass
            return failed.value

    assert asyncio.run(main()).code == "engine_failure"


def test_unknown_request_is_not_retried(clients_stack: ClientStack, api_key: str) -> None:
    with Client(clients_stack.url, api_key) as client:
        stream = client.resume("chatcmpl-doesnotexist")
        with pytest.raises(LastEventError) as missing:
            stream.text()
    assert missing.value.status == 404
    assert stream.reconnects == 0


# ------------------------------------------------------- SSE handling, no server at all


class _Cut(httpx.SyncByteStream):
    """Bytes in the given pieces, then a broken connection (as httpx reports one)."""

    def __init__(self, pieces: list[bytes]) -> None:
        self.pieces = pieces

    def __iter__(self) -> Iterator[bytes]:
        yield from self.pieces
        raise httpx.RemoteProtocolError("peer closed connection (cut)")


def _frame(data: str, event_id: str, data_first: bool) -> bytes:
    lines = [f"data: {data}\n", f"id: {event_id}\n"]
    return "".join(lines if data_first else lines[::-1]).encode() + b"\n"


texts = st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    parts=texts,
    data_first=st.booleans(),
    cuts=st.lists(st.floats(0, 1), max_size=6),
    pieces=st.integers(1, 7),
    pings=st.booleans(),
)
def test_any_cut_loses_nothing_and_repeats_nothing(
    parts: list[str], data_first: bool, cuts: list[float], pieces: int, pings: bool
) -> None:
    """A server sending ``parts`` as chunks, its connections cut at arbitrary bytes
    (inside a multi-byte character, a line, between an event's lines): the client's state,
    fed by httpx-sse, resumes after the last whole event and ends with every part once."""
    events = []
    for i, part in enumerate(parts):
        chunk = {"choices": [{"index": 0, "delta": {"content": part}, "finish_reason": None}]}
        events.append((f"1-{i}", json.dumps(chunk, ensure_ascii=False)))
    final = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    events.append((f"1-{len(parts)}:0", json.dumps(final)))
    events.append((f"1-{len(parts)}", "[DONE]"))
    order = [eid for eid, _ in events]

    state = StreamState(
        path="/v1/chat/completions",
        body={"model": "m", "messages": []},
        api_key=None,
        idempotency_key="k",
        backoff=Backoff(),
        rng=random.Random(0),
        request_id="r",
    )
    got: list[str] = []
    connections = 0
    remaining_cuts = list(cuts)
    while not state.done:
        connections += 1
        assert connections <= len(cuts) + 1
        call = state.next_call()
        after = call.headers.get("Last-Event-ID")
        start = 0 if after is None else order.index(after) + 1
        body = b"retry: 100\n" + b"".join(
            (b": ping\n" if pings else b"") + _frame(d, e, data_first) for e, d in events[start:]
        )
        if remaining_cuts:  # cut this connection somewhere
            body = body[: int(remaining_cuts.pop(0) * len(body))]
        size = max(1, len(body) // pieces)
        chunks = [body[i : i + size] for i in range(0, len(body), size)]
        response = httpx.Response(
            200, headers={"content-type": "text/event-stream"}, stream=_Cut(chunks)
        )
        assert state.on_response(200, response.headers, None) == "read"
        try:
            for sse in EventSource(response).iter_sse():
                chunk = state.on_event(sse)
                if chunk is not None:
                    got.append(text_of(chunk))
                if state.done:
                    break
        except httpx.RemoteProtocolError as exc:
            state.on_broken(exc)
        if not state.done:
            assert state.next_delay() >= 0.1  # the `retry:` hint, when it arrived
    assert "".join(got) == "".join(parts)
    assert got[: len(parts)] == parts
    assert state.finish_reason == "stop"
