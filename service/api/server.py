"""``lastevent api``: uvicorn, configured for long-lived streams.

``run`` serves the app: graceful shutdown bounded by ``drain_s`` (our SIGTERM hook
tells open streams to reconnect first), the gate (``gate.py``: Host names, a request cap
that never refuses a probe), uvicorn's connection cap far above it as a last guard,
a header-flood cap, the send timeout (``asgi.py``) and the slowloris guard below.

uvicorn's HTTP/1.1 protocols have no timeout for reading a request: a client that
sends its head (or body) a byte at a time holds a connection for ever (slowloris).
The guarded protocols close a connection whose request is not complete within
``read_timeout_s`` of the connection (or of the previous response) -- after that
the response streams for as long as it needs. ``LASTEVENT_HTTP`` picks httptools
(llhttp, in C: the default; h11 cost the API 1.1-1.2x its CPU per streamed token) or
h11 (pure Python); ``LASTEVENT_EVENT_LOOP`` uvloop (the default) or asyncio.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api import tokens
from service.api.app import create_app
from service.api.asgi import SendTimeoutMiddleware
from service.api.context import Drain
from service.api.gate import Gate, Hosts
from service.settings import Http, Settings
from service.store.local import LocalFeed


def run(settings: Settings) -> None:
    server(settings).run()


def server(
    settings: Settings, feed: LocalFeed | None = None, on_exit: Callable[[], None] | None = None
) -> uvicorn.Server:
    """The API's uvicorn server; in a node (``service/cli/node.py``) ``feed`` is its
    worker's appends and ``on_exit`` stops that worker when a signal stops the server."""
    drain = Drain()

    class DrainingServer(uvicorn.Server):
        """On SIGTERM/SIGINT: stop accepting, tell open streams to reconnect, then exit
        (uvicorn waits up to ``drain_s`` for connections, then cancels what is left)."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            drain.start()
            if on_exit is not None:
                on_exit()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        Gate(
            SendTimeoutMiddleware(create_app(settings, drain, feed), settings.send_timeout_s),
            Hosts.parse(settings.allowed_hosts),
            max_in_flight=settings.max_streams + 100,  # then 503, but never to a probe
        ),
        host=settings.host,
        port=settings.port,
        log_level="info",
        lifespan="on",
        timeout_graceful_shutdown=int(settings.drain_s),
        timeout_keep_alive=5,  # idle keep-alive connections
        server_header=False,  # fewer bytes before the ones that matter (CORS, see asgi.py)
        # uvicorn's own cap answers 503 to everything, probes too: only a last guard
        limit_concurrency=2 * (settings.max_streams + 100),
        # X-Forwarded-For names the client only from these (none: the peer is the client)
        proxy_headers=bool(settings.trusted_proxies.strip()),
        forwarded_allow_ips=settings.trusted_proxies.strip() or None,
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,  # header flood guard (h11)
        http=protocol(settings),  # with the slowloris and header flood guards
        ws="websockets-sansio",  # the Responses WebSocket mode (routes/responses_ws.py)
        ws_max_size=settings.max_body_bytes,  # a message is a request body
        loop=settings.event_loop,  # uvloop (libuv) by default
    )
    # stream tokens travel in the query string: the access log shows it without them
    logging.getLogger("uvicorn.access").addFilter(RedactTokens())
    return DrainingServer(config)


MAX_HEAD_BYTES = 64 * 1024  # a request's line and headers


def protocol(settings: Settings) -> type[asyncio.Protocol]:
    """The HTTP/1.1 implementation ``LASTEVENT_HTTP`` names, guarded."""
    if settings.http is Http.H11:
        return guarded_h11(settings.request_read_timeout_s)
    return guarded_httptools(settings.request_read_timeout_s, MAX_HEAD_BYTES)


class RedactTokens(logging.Filter):
    """Drop the value of ``token=`` from every access log line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(tokens.redact(a) if isinstance(a, str) else a for a in record.args)
        return True


class _ReadDeadline:
    """The slowloris guard, for either protocol class: a connection whose request is not
    all in within ``read_timeout_s`` of the connection (or of the response before it) is
    closed. A request that is all in -- also one pipelined behind another, received while
    that one was answered -- is not timed: its response takes as long as it needs."""

    read_timeout_s: float
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    logger: logging.Logger
    _read_timer: asyncio.TimerHandle | None = None
    _received = 0  # requests all in so far
    _answered = 0  # responses complete so far

    def _arm(self) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(self.read_timeout_s, self._read_timed_out)

    def _disarm(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _request_complete(self) -> None:
        self._received += 1
        self._disarm()

    def _response_complete(self) -> None:
        """The next request gets its own deadline, unless it is all in already."""
        self._answered += 1
        if self._received <= self._answered and not self.transport.is_closing():
            self._arm()

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing():
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

        _counted: object = None  # the h11 cycle whose request was counted in

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is h11.DONE and self._counted is not self.cycle:
                self._counted = self.cycle  # the whole request is in
                self._request_complete()

        def on_response_complete(self) -> None:
            # (timed first: uvicorn handles a request already buffered behind it right away)
            self._response_complete()
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_websocket_upgrade(self, event: h11.Request) -> None:
            self._disarm()  # the socket is the WebSocket protocol's from here
            super().handle_websocket_upgrade(event)

    GuardedH11.read_timeout_s = read_timeout_s
    return GuardedH11


class GuardedHttpTools(_ReadDeadline, HttpToolsProtocol):
    """uvicorn's httptools protocol (llhttp, in C) with the slowloris guard and a header
    flood guard (llhttp puts no bound on a request's head): a head over ``max_head_bytes``
    is answered 431 and the connection closed."""

    max_head_bytes = MAX_HEAD_BYTES
    _in_head = True  # reading a request's head (until its headers are complete)
    _head_bytes = 0  # what arrived of the head in progress
    _parsed = 0  # its URL and headers as parsed
    _flooded = False

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._flooded:
            return
        if self._in_head:
            self._head_bytes += len(data)  # (a bound: part of it may be the body)
        super().data_received(data)
        # still in the head after all of it, or its parsed parts too long
        if self._flooded or (self._in_head and self._head_bytes > self.max_head_bytes):
            self._too_large()

    def _count(self, n: int) -> bool:
        """Count parsed head bytes; False once the head is too large."""
        self._parsed += n
        if self._parsed > self.max_head_bytes:
            self._flooded = True
        return not self._flooded

    def on_message_begin(self) -> None:
        self._in_head, self._head_bytes, self._parsed = True, 0, 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        if self._count(len(url)):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._count(len(name) + len(value) + 4):
            super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        if not self._flooded:  # a flooded request never reaches the app
            super().on_headers_complete()

    def on_body(self, body: bytes) -> None:
        if not self._flooded:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._flooded:
            super().on_message_complete()
            self._request_complete()

    def _too_large(self) -> None:
        self._flooded = True
        if self.transport.is_closing():
            return
        self.logger.info(
            "closing a connection whose request head is over %d B", self.max_head_bytes
        )
        body = b"request header fields too large"
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._response_complete()

    def handle_websocket_upgrade(self) -> None:
        self._disarm()  # the socket is the WebSocket protocol's from here
        super().handle_websocket_upgrade()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def guarded_httptools(read_timeout_s: float, max_head_bytes: int) -> type[HttpToolsProtocol]:
    """``GuardedHttpTools`` with these bounds."""
    bounds = {"read_timeout_s": read_timeout_s, "max_head_bytes": max_head_bytes}
    return type("GuardedHttpTools", (GuardedHttpTools,), bounds)
