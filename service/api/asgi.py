"""ASGI middleware: cut off a client that stops reading.

A response body ``send`` only returns once the server's transport accepts the bytes;
for a client that stopped reading it blocks when the socket buffers are full. The log
decouples the engine from readers, so such a client never slows generation -- but it
would hold a connection and a reader forever. After ``send_timeout_s`` without
progress the send fails, the response task ends and the server closes the connection.
A WebSocket's messages are timed the same way.

No timer per send (``asyncio.wait_for`` cost ~12 us a send, a task each; at 10,000
events/s that was an eighth of a core): each send notes when it started, and one
watchdog per process cancels a send that has been blocked for longer than the timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

Scope = dict[str, Any]
Message = dict[str, Any]


class SendTimeout(Exception):
    """The client accepted no bytes within the send timeout."""


class SendTimeoutMiddleware:
    def __init__(self, app: Any, timeout_s: float) -> None:
        self.app = app
        self.timeout_s = timeout_s
        self._sending: dict[asyncio.Task[Any], float] = {}  # task -> when its send began
        self._expired: set[asyncio.Task[Any]] = set()
        self._watchdog: asyncio.Task[None] | None = None

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        loop = asyncio.get_running_loop()
        if self._watchdog is None or self._watchdog.done():
            self._watchdog = loop.create_task(self._watch(), name="send-timeout")

        async def timed_send(message: Message) -> None:
            task = asyncio.current_task()
            if message["type"] == "http.response.start":
                message["headers"] = _cors_first(message.get("headers", []))
            if message["type"] not in _TIMED or task is None:
                await send(message)
                return
            self._sending[task] = loop.time()
            try:
                await send(message)
            except asyncio.CancelledError:
                if task not in self._expired:
                    raise
                self._expired.discard(task)
                task.uncancel()  # our cancel, not the caller's: it becomes an error
                raise SendTimeout(f"client accepted nothing for {self.timeout_s:g} s") from None
            finally:
                self._sending.pop(task, None)

        await self.app(scope, receive, timed_send)

    async def _watch(self) -> None:
        """Every quarter of the timeout (at most 1 s): cancel sends blocked too long."""
        loop = asyncio.get_running_loop()
        every_s = min(1.0, self.timeout_s / 4)
        while True:
            await asyncio.sleep(every_s)
            due = loop.time() - self.timeout_s
            for task, since in list(self._sending.items()):
                if since <= due and task not in self._expired:
                    self._expired.add(task)
                    with contextlib.suppress(RuntimeError):
                        task.cancel()


_TIMED = frozenset({"http.response.body", "websocket.send"})  # a body's bytes, a message


def _cors_first(headers: Any) -> list[Any]:
    """The CORS headers and the content type first. A browser takes a header block cut
    short by the network as whole (over plain http): if ``Access-Control-Allow-Origin``
    (or ``Content-Type: text/event-stream``) had not arrived yet, the response fails and
    an ``EventSource`` closes for good instead of reconnecting. First, they arrive
    within the first ~200 bytes of any response."""
    first = [h for h in headers if _early(bytes(h[0]))]
    return first + [h for h in headers if not _early(bytes(h[0]))]


def _early(name: bytes) -> bool:
    name = name.lower()
    return name.startswith(b"access-control-") or name == b"content-type"
