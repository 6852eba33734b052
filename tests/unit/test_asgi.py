"""The send-timeout middleware cuts off a client that accepts no bytes."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from service.api.asgi import SendTimeout, SendTimeoutMiddleware


async def streaming_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for i in range(100):
        await send({"type": "http.response.body", "body": b"x" * 10, "more_body": i < 99})


async def test_frozen_client_is_cut_off() -> None:
    sent: list[bytes] = []
    frozen = asyncio.Event()
    blocked_sends_cancelled = 0

    async def send(message: dict[str, Any]) -> None:
        nonlocal blocked_sends_cancelled
        if message["type"] == "http.response.body":
            if len(sent) == 3:
                try:
                    await frozen.wait()  # the client's buffers are full: never returns
                except asyncio.CancelledError:
                    blocked_sends_cancelled += 1
                    raise
            sent.append(message["body"])

    app = SendTimeoutMiddleware(streaming_app, timeout_s=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(SendTimeout):
        # the safety net only: a hang here is the bug, not a slow machine
        await asyncio.wait_for(app({"type": "http"}, None, send), 60)
    # the blocked send itself was cancelled, after the timeout and not before: the watchdog
    # compares the loop clock with the send's start, so this lower bound is the code's own
    assert blocked_sends_cancelled == 1
    assert loop.time() - started >= 0.2
    assert len(sent) == 3
    assert not frozen.is_set()


async def test_reading_client_gets_everything() -> None:
    sent: list[bytes] = []

    async def send(message: dict[str, Any]) -> None:
        await asyncio.sleep(0)
        if message["type"] == "http.response.body":
            sent.append(message["body"])

    await SendTimeoutMiddleware(streaming_app, timeout_s=0.2)({"type": "http"}, None, send)
    assert len(sent) == 100


async def test_a_cancel_from_elsewhere_stays_a_cancel() -> None:
    """The client went away (the server cancels the response task): not a send timeout."""
    blocked = asyncio.Event()

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body":
            blocked.set()
            await asyncio.Event().wait()

    app = SendTimeoutMiddleware(streaming_app, timeout_s=30)
    task = asyncio.ensure_future(app({"type": "http"}, None, send))
    await blocked.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
