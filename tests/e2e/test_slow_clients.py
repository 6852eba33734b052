"""Slowloris: a client that sends its request a byte at a time is cut off. Keepalives:
a stream with nothing to say (a long prefill) still sends a comment line regularly."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Stack, running


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("slow"),
        redis_url,
        database_url,
        model_dir,
        request_read_timeout_s=1.5,
        keepalive_s=0.4,
        scripted_prefill_s=1.6,
    ) as st:
        yield st


def test_slowloris_is_cut_off(stack: Stack) -> None:
    port = int(stack.url.rsplit(":", 1)[1])
    started = time.monotonic()  # before the server can have seen the connection
    sock = socket.create_connection(("127.0.0.1", port))
    sock.settimeout(10)
    closed_at = None
    # a byte each 0.1 s: the request would take 23 s, the cut comes at its read timeout
    for byte in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200:
        try:
            sock.sendall(bytes([byte]))
            time.sleep(0.1)
        except OSError:
            closed_at = time.monotonic()
            break
        if _closed(sock):
            closed_at = time.monotonic()
            break
    sock.close()
    assert closed_at is not None, "the server kept the slow connection open"
    print(f"\nslowloris: cut off after {closed_at - started:.1f} s (limit 1.5 s)")
    # by the read timeout, not earlier (the server's timer starts when it has the connection)
    assert closed_at - started >= 1.5 - 0.001
    # a normal client meanwhile is served, and a long stream is not cut by the read timeout
    assert httpx.get(stack.url + "/healthz").status_code == 200


def _readable(sock: socket.socket) -> bool:
    import select

    return bool(select.select([sock], [], [], 0)[0])


def _closed(sock: socket.socket) -> bool:
    if not _readable(sock):
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


def test_a_long_stream_outlives_the_read_timeout(stack: Stack) -> None:
    from tests.e2e.helpers import LONG, chat_body, content_of, finish_reason, read_all

    with httpx.Client(base_url=stack.url, timeout=30) as client:
        started = time.monotonic()
        _, events = read_all(
            client,
            "POST",
            "/v1/chat/completions",
            json=chat_body(stack.model, LONG * 2, stream=True, max_tokens=400),
        )
        took = time.monotonic() - started
    # the premise, which the 1.6 s prefill guarantees: the stream outlasted the read timeout
    assert took > 1.5
    # and it was not cut: the whole answer, then the end
    assert events[-1].data == "[DONE]" and len(content_of(events)) > 100
    assert finish_reason(events) == "length"


def test_idle_stream_gets_keepalives_then_its_answer(stack: Stack) -> None:
    """One ticker for all readers sends them (no timer per reader): every 0.4 s of silence
    during the 1.6 s prefill gives a `: ping`, then the answer comes as usual."""
    from tests.e2e.helpers import chat_body

    pings_before_content = 0
    content = []
    first_content_after = None
    with httpx.Client(timeout=30) as client:
        started = time.monotonic()
        with client.stream(
            "POST",
            stack.url + "/v1/chat/completions",
            json=chat_body(stack.model, "still there", stream=True),
        ) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line == ": ping" and not content:
                    pings_before_content += 1
                elif (
                    line.startswith("data: ")
                    and '"content":"' in line
                    and '"content":""' not in line
                ):
                    if not content:
                        first_content_after = time.monotonic() - started
                    content.append(line)
                elif line == "data: [DONE]":
                    break
    assert content and first_content_after is not None
    # pings came during the silence, more than once ...
    assert pings_before_content >= 2, pings_before_content
    # ... and each only after 0.4 s without anything sent (a ping counts as something): in
    # the silence before the first content, however long it lasted, at most one per 0.4 s
    assert pings_before_content <= first_content_after / 0.4, (
        pings_before_content,
        first_content_after,
    )


def test_an_idle_responses_stream_gets_keepalives_too(stack: Stack) -> None:
    """A Responses stream during the same 1.6 s prefill: `: ping` lines (a proxy's idle
    timeout would otherwise cut it), and the official SDK reads through them to the end."""
    from openai import OpenAI

    pings_before_text = 0
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST",
            stack.url + "/v1/responses",
            json={"model": stack.model, "input": "still there", "stream": True},
        ) as r,
    ):
        assert r.status_code == 200
        for line in r.iter_lines():
            if line == ": ping":
                pings_before_text += 1
            elif line == "event: response.output_text.delta":
                break
    assert pings_before_text >= 2, pings_before_text
    with OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0) as sdk:
        events = list(sdk.responses.create(model=stack.model, input="still there", stream=True))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "still there"  # type: ignore[union-attr]
