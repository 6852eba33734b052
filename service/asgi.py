"""ASGI middleware: cut off a client that stops reading.

A response body ``send`` only returns once the server's transport accepts the bytes;
for a client that stopped reading it blocks when the socket buffers are full. The log
decouples the engine from readers, so such a client never slows generation -- but it
would hold a connection and a reader forever. After ``send_timeout_s`` without
progress the send fails, the response task ends and the server closes the connection.
"""

from __future__ import annotations

import asyncio
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]


class SendTimeout(Exception):
    """The client accepted no bytes within the send timeout."""


class SendTimeoutMiddleware:
    def __init__(self, app: Any, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def timed_send(message: Message) -> None:
            if message["type"] != "http.response.body":
                await send(message)
                return
            try:
                await asyncio.wait_for(send(message), self.timeout_s)
            except TimeoutError:
                raise SendTimeout(f"client accepted nothing for {self.timeout_s:g} s") from None

        await self.app(scope, receive, timed_send)
