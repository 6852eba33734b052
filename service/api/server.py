"""``lastevent api``: uvicorn, configured for long-lived streams.

``run`` serves the app: graceful shutdown bounded by ``drain_s`` (our SIGTERM hook
tells open streams to reconnect first), a connection cap just above the stream cap,
a header-flood cap, the send timeout (``asgi.py``) and the slowloris guard below.

uvicorn's HTTP/1.1 protocols have no timeout for reading a request: a client that
sends its head (or body) a byte at a time holds a connection for ever (slowloris).
The guarded protocols close a connection whose request is not complete within
``read_timeout_s`` of the connection (or of the previous response) -- after that
the response streams for as long as it needs. ``LASTEVENT_HTTP`` picks httptools
(llhttp, in C: the default; it costs about half of h11's CPU per streamed event) or
h11 (pure Python); ``LASTEVENT_EVENT_LOOP`` uvloop (the default) or asyncio.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api import tokens
from service.api.app import create_app
from service.api.asgi import SendTimeoutMiddleware
from service.api.context import Drain
from service.settings import Settings


def run(settings: Settings) -> None:
    drain = Drain()

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: stop accepting, tell open streams to reconnect, then exit
        (uvicorn waits up to ``drain_s`` for connections, then cancels what is left)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            drain.start()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        SendTimeoutMiddleware(create_app(settings, drain), settings.send_timeout_s),
        host=settings.host,
        port=settings.port,
        log_level="info",
        lifespan="on",
        timeout_graceful_shutdown=int(settings.drain_s),
        timeout_keep_alive=5,  # idle keep-alive connections
        server_header=False,  # fewer bytes before the ones that matter (CORS, see asgi.py)
        limit_concurrency=settings.max_streams + 100,  # beyond it uvicorn answers 503 itself
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,  # header flood guard (h11)
        http=protocol(settings),  # with the slowloris and header flood guards
        loop=settings.event_loop,  # uvloop (libuv) by default
    )
    # stream tokens travel in the query string: the access log shows it without them
    logging.getLogger("uvicorn.access").addFilter(RedactTokens())
    DrainingServer(config).run()


MAX_HEAD_BYTES = 64 * 1024  # a request's line and headers


def protocol(settings: Settings) -> type[asyncio.Protocol]:
    """The HTTP/1.1 implementation ``LASTEVENT_HTTP`` names, guarded."""
    if settings.http == "h11":
        return guarded_h11(settings.request_read_timeout_s)
    if settings.http == "httptools":
        return guarded_httptools(settings.request_read_timeout_s, MAX_HEAD_BYTES)
    raise ValueError(f"LASTEVENT_HTTP={settings.http!r}: httptools or h11")


class RedactTokens(logging.Filter):
    """Drop the value of ``token=`` from every access log line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(tokens.redact(a) if isinstance(a, str) else a for a in record.args)
        return True


class _ReadDeadline:
    """The slowloris guard, for either protocol class: a connection whose request is not
    all in within ``read_timeout_s`` of the connection (or of the previous response) is
    closed; ``request_in`` says when it is (then the response takes as long as it needs)."""

    read_timeout_s: float
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    logger: logging.Logger
    _read_timer: asyncio.TimerHandle | None = None
    request_in = False

    def _arm(self) -> None:
        self._disarm()
        self.request_in = False
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _request_complete(self) -> None:
        self.request_in = True
        self._disarm()

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.request_in and not self.transport.is_closing():
            self.logger.info(
                "closing a connection whose request took over %ss", self.read_timeout_s
            )
            self.transport.close()


def guarded_h11(read_timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol (pure Python) with the slowloris guard; its header flood guard
    is h11's own (``h11_max_incomplete_event_size``)."""

    class GuardedH11(_ReadDeadline, H11Protocol):
        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is h11.DONE:  # the whole request is in
                self._request_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection gets its own deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    GuardedH11.read_timeout_s = read_timeout_s
    return GuardedH11


def guarded_httptools(read_timeout_s: float, max_head_bytes: int) -> type[HttpToolsProtocol]:
    """uvicorn's httptools protocol (llhttp, in C) with the slowloris guard and a header
    flood guard (llhttp puts no bound on a request's head): a head over ``max_head_bytes``
    is answered 431 and the connection closed."""

    class GuardedHttpTools(_ReadDeadline, HttpToolsProtocol):
        _head_bytes = 0
        _in_head = True  # reading a request's head (until its headers are complete)

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            if self._in_head:
                self._head_bytes += len(data)
                if self._head_bytes > max_head_bytes:
                    self._too_large()
                    return
            super().data_received(data)

        def _too_large(self) -> None:
            self.logger.info(
                "closing a connection whose request head is over %d bytes", max_head_bytes
            )
            self._in_head = False
            body = b"request header fields too large"
            self.transport.write(
                b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
                b"content-length: %d\r\n\r\n%s" % (len(body), body)
            )
            self.transport.close()

        def on_headers_complete(self) -> None:
            self._in_head = False
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            super().on_message_complete()
            self._request_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._in_head, self._head_bytes = True, 0
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    GuardedHttpTools.read_timeout_s = read_timeout_s
    return GuardedHttpTools
