"""``lastevent api``: uvicorn, configured for long-lived streams.

``run`` serves the app: graceful shutdown bounded by ``drain_s`` (our SIGTERM hook
tells open streams to reconnect first), a connection cap just above the stream cap,
a header-flood cap, the send timeout (``asgi.py``) and the slowloris guard below.

uvicorn's HTTP/1.1 protocol has no timeout for reading a request: a client that
sends its head (or body) a byte at a time holds a connection for ever (slowloris).
``GuardedH11`` closes a connection whose request is not complete within
``read_timeout_s`` of the connection (or of the previous response) -- after that
the response streams for as long as it needs.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

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
        h11_max_incomplete_event_size=64 * 1024,  # header flood guard
        http=guarded_h11(settings.request_read_timeout_s),  # slowloris guard
    )
    # stream tokens travel in the query string: the access log shows it without them
    logging.getLogger("uvicorn.access").addFilter(RedactTokens())
    DrainingServer(config).run()


class RedactTokens(logging.Filter):
    """Drop the value of ``token=`` from every access log line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(tokens.redact(a) if isinstance(a, str) else a for a in record.args)
        return True


def guarded_h11(read_timeout_s: float) -> type[H11Protocol]:
    class GuardedH11(H11Protocol):
        _read_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._read_timer = self.loop.call_later(read_timeout_s, self._read_timed_out)

        def _disarm(self) -> None:
            if self._read_timer is not None:
                self._read_timer.cancel()
                self._read_timer = None

        def _read_timed_out(self) -> None:
            self._read_timer = None
            if self.conn.their_state is not h11.DONE and not self.transport.is_closing():
                self.logger.info("closing a connection whose request took over %ss", read_timeout_s)
                self.transport.close()

        def handle_events(self) -> None:
            super().handle_events()
            if self.conn.their_state is h11.DONE:  # the whole request is in
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this connection gets its own deadline

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return GuardedH11
