"""The HTTP/1.1 guards of ``service/api/server.py``, on real uvicorn servers.

One server per implementation (``LASTEVENT_HTTP``: httptools and h11), each started the
way ``server.run`` starts the API (``protocol(settings)``, ``MAX_HEAD_BYTES``) with a
one-second read timeout, serving a tiny raw ASGI app. Checked, byte by byte on raw
sockets where bytes matter:

- slowloris: a request head, or a body, that trickles in is cut off at the read timeout
  (not before) while other clients are served;
- a request that is all in is answered for as long as the answer takes: a response that
  streams longer than the read timeout, also on a pipelined request;
- keep-alive: each request on a connection gets its own deadline, from the previous
  response;
- header flood: a head over ``MAX_HEAD_BYTES`` is refused with a 4xx and the connection
  closed; one just under it, or a small head with a large body, is served;
- ``protocol`` refuses an unknown implementation.

Where a guard falls short (``known_bug``) the test is a strict xfail for that
implementation, its reason saying how: a fix turns it into a failing XPASS.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import select
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from types import TracebackType
from typing import Any

import httpx
import pytest
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from service.api.server import MAX_HEAD_BYTES, protocol
from service.settings import Settings
from tests.e2e.conftest import free_port

IMPLEMENTATIONS = ["httptools", "h11"]
READ_TIMEOUT_S = 1.0
SLACK_S = 5.0  # generous: a cut must come within the read timeout plus this
BYTE_INTERVAL_S = 0.1  # a slow client's pace
IO_TIMEOUT_S = 10.0  # the most a test waits for the server's next bytes
STREAM_CHUNKS = 5
STREAM_PAUSE_S = 0.5  # /stream takes STREAM_CHUNKS * STREAM_PAUSE_S: longer than the timeout
HOLD_S = 0.3  # /hold blocks the server's event loop this long

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """``/``: 200 "ok". ``/stream``: a few chunks over a while, then the body's length.
    ``/hold``: 200 "ok", its head sent before it blocks the event loop for ``HOLD_S``
    (meanwhile what clients send piles up, to be read at once). All read the whole
    request body first."""
    assert scope["type"] == "http"
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
        size += len(message.get("body", b""))
        if not message.get("more_body", False):
            break
    if scope["path"] == "/stream":
        start = {"type": "http.response.start", "status": 200}
        await send({**start, "headers": [(b"content-type", b"text/plain")]})
        for i in range(STREAM_CHUNKS):
            await send({"type": "http.response.body", "body": b"chunk %d\n" % i, "more_body": True})
            await asyncio.sleep(STREAM_PAUSE_S)
        await send({"type": "http.response.body", "body": b"received %d bytes\n" % size})
        return
    headers = [(b"content-type", b"text/plain"), (b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if scope["path"] == "/hold":
        time.sleep(HOLD_S)  # blocking the loop is the point
    await send({"type": "http.response.body", "body": b"ok"})


def stream_body(received: int) -> bytes:
    """What /stream answers to a request body of ``received`` bytes."""
    chunks = b"".join(b"chunk %d\n" % i for i in range(STREAM_CHUNKS))
    return chunks + b"received %d bytes\n" % received


@dataclasses.dataclass(frozen=True)
class Served:
    impl: str
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@pytest.fixture(scope="module", params=IMPLEMENTATIONS)
def served(request: pytest.FixtureRequest) -> Iterator[Served]:
    """A uvicorn server in a thread, guarded as ``server.run`` guards the API."""
    impl: str = request.param
    settings = Settings(http=impl, request_read_timeout_s=READ_TIMEOUT_S)
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        http=protocol(settings),
        h11_max_incomplete_event_size=MAX_HEAD_BYTES,
        loop=settings.event_loop,
        lifespan="off",
        log_level="warning",
        # idle keep-alive connections: longer than any cut a test waits for, so that
        # every cut seen here is the read timeout's
        timeout_keep_alive=30,
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"uvicorn-{impl}", daemon=True)
    thread.start()
    deadline = time.monotonic() + IO_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"uvicorn ({impl}) did not start")
        time.sleep(0.01)
    try:
        yield Served(impl, port)
    finally:
        server.should_exit = True
        thread.join(timeout=IO_TIMEOUT_S)
        assert not thread.is_alive(), f"uvicorn ({impl}) did not stop"


@dataclasses.dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


class Conn:
    """A raw client connection: what the server sent is kept in ``buf``, and ``eof``
    says when it closed the connection (a reset counts as a close)."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S)
        self.buf = b""
        self.received = 0  # bytes, in all
        self.eof = False

    def __enter__(self) -> Conn:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _recv(self, timeout: float) -> bool:
        """Read what arrives within ``timeout``; False when nothing did."""
        if self.eof:
            return False
        ready, _, _ = select.select([self.sock], [], [], max(timeout, 0.0))
        if not ready:
            return False
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            data = b""
        self.buf += data
        self.received += len(data)
        self.eof = not data
        return True

    def closed_within(self, timeout: float) -> float | None:
        """When the server closed the connection, if it did within ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self._recv(left)
        return time.monotonic()

    def trickle(self, data: bytes) -> float | None:
        """Send ``data`` a byte each ``BYTE_INTERVAL_S``: when the server closed the
        connection meanwhile, or None if it never did."""
        for byte in data:
            try:
                self.send(bytes([byte]))
            except OSError:  # closed (and reset) between two bytes
                return time.monotonic()
            closed_at = self.closed_within(BYTE_INTERVAL_S)
            if closed_at is not None:
                return closed_at
        return None

    def _more(self) -> None:
        if not self._recv(IO_TIMEOUT_S) or self.eof:
            what = "closed" if self.eof else f"went quiet for {IO_TIMEOUT_S}s"
            raise AssertionError(f"the connection {what} mid-response ({self.received} bytes in)")

    def wait_for(self, marker: bytes) -> None:
        """Read until ``buf`` holds ``marker``."""
        while marker not in self.buf:
            self._more()

    def read_response(self) -> Response:
        """The next response (Content-Length or chunked), taken out of ``buf``."""
        self.wait_for(b"\r\n\r\n")
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines)}
        if "content-length" in headers:
            size = int(headers["content-length"])
            while len(self.buf) < size:
                self._more()
            body, self.buf = self.buf[:size], self.buf[size:]
        else:
            assert headers.get("transfer-encoding") == "chunked", headers
            body = self._read_chunked()
        return Response(int(status_line.split()[1]), headers, body)

    def _read_chunked(self) -> bytes:
        body = b""
        while True:
            while b"\r\n" not in self.buf:
                self._more()
            size_line, rest = self.buf.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0], 16)
            while len(rest) < size + 2:
                self._more()
                rest = self.buf.split(b"\r\n", 1)[1]
            body += rest[:size]
            self.buf = rest[size + 2 :]
            if size == 0:  # (no trailers here)
                return body


def get(path: str) -> bytes:
    return b"GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path.encode()


def padded_head(size: int) -> bytes:
    """A GET whose line and headers come to ``size`` bytes, in ~1 KiB ``X-Pad-i`` lines."""
    head, end = b"GET / HTTP/1.1\r\nHost: x\r\n", b"\r\n"
    i = 0
    while size - len(head) - len(end) > 2100:
        head += b"X-Pad-%d: %s\r\n" % (i, b"a" * 1000)
        i += 1
    name = b"X-Pad-%d: " % i
    value = size - len(head) - len(end) - len(name) - 2
    assert value > 0
    head += name + b"a" * value + b"\r\n" + end
    assert len(head) == size
    return head


def known_bug(request: pytest.FixtureRequest, served: Served, impls: set[str], why: str) -> None:
    """The test fails on ``impls`` (a guard's bug, see ``why``): strict xfail there, so that
    the fix shows up as XPASS, failing, and this call is removed then."""
    if served.impl in impls:
        request.applymarker(pytest.mark.xfail(reason=why, strict=True))


def assert_cut(closed_at: float | None, since: float) -> None:
    """Cut off by the read timeout: not before it (counted from ``since``, a moment
    before the server could start counting), and not much after."""
    assert closed_at is not None, "the server kept the slow connection open"
    assert closed_at - since >= READ_TIMEOUT_S - 0.001, f"cut early: {closed_at - since:.3f}s"
    assert closed_at - since < READ_TIMEOUT_S + SLACK_S, f"cut late: {closed_at - since:.3f}s"


def test_slow_head_is_cut_off(served: Served) -> None:
    head = b"GET / HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200 + b"\r\n\r\n"  # 24 s's worth
    started = time.monotonic()
    with Conn(served.port) as conn:
        conn.send(head[:1])
        # another client meanwhile is served
        answer = httpx.get(served.url + "/", timeout=IO_TIMEOUT_S)
        assert (answer.status_code, answer.text) == (200, "ok")
        closed_at = conn.trickle(head[1:])
    assert_cut(closed_at, started)


def test_slow_body_is_cut_off(served: Served) -> None:
    head = b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n"
    started = time.monotonic()
    with Conn(served.port) as conn:
        conn.send(head)  # all at once: the body is the slow part (10 s's worth)
        closed_at = conn.trickle(b"a" * 100)
    assert_cut(closed_at, started)


def test_a_long_response_is_not_cut(served: Served) -> None:
    """The request is all in: its response streams past the read timeout, to its end."""
    started = time.monotonic()
    with httpx.stream(
        "POST", served.url + "/stream", content=b"x" * 100, timeout=IO_TIMEOUT_S
    ) as answer:
        assert answer.status_code == 200
        body = b"".join(answer.iter_bytes())
    assert body == stream_body(100)
    assert time.monotonic() - started > READ_TIMEOUT_S  # (the stream sleeps for longer)


def test_a_long_pipelined_response_is_not_cut(served: Served) -> None:
    """Two requests sent at once: the second is all in before the first is answered,
    so its response too streams past the read timeout, to its end."""
    with Conn(served.port) as conn:
        conn.send(get("/") + get("/stream"))
        first = conn.read_response()
        assert (first.status, first.body) == (200, b"ok")
        second = conn.read_response()
    assert (second.status, second.body) == (200, stream_body(0))


def test_keep_alive_requests_each_get_a_deadline(served: Served) -> None:
    started = time.monotonic()
    with Conn(served.port) as conn:
        for _ in range(2):
            time.sleep(0.6)
            sent = time.monotonic()
            conn.send(get("/"))
            answer = conn.read_response()
            assert (answer.status, answer.body) == (200, b"ok")
        # the second request came after the first deadline: each response restarts it
        assert sent - started > READ_TIMEOUT_S
        # a third request whose head never ends is cut, a read timeout after the second
        # response (which came after ``sent``)
        conn.send(b"GET / HTTP/1.1\r\nHost: x\r\n")
        closed_at = conn.closed_within(READ_TIMEOUT_S + SLACK_S)
    assert_cut(closed_at, sent)


def assert_refused(served: Served, head: bytes) -> None:
    """``head``, sent at once, is answered 4xx and the connection closed."""
    with Conn(served.port) as conn:
        with contextlib.suppress(OSError):  # it may close before it has read it all
            conn.send(head)
        closed_at = conn.closed_within(IO_TIMEOUT_S)
    status_line = conn.buf.split(b"\r\n", 1)[0]
    assert status_line.startswith(b"HTTP/1.1 4"), conn.buf[:300]
    # httptools: the guard's 431; h11: uvicorn's "400 Bad Request" for h11's error
    expected = {431} if served.impl == "httptools" else {400, 431}
    assert int(status_line.split()[1]) in expected, status_line
    assert closed_at is not None, "the server kept the flooding connection open"


def test_header_flood_is_refused(served: Served, request: pytest.FixtureRequest) -> None:
    known_bug(
        request,
        served,
        {"h11"},
        "h11_max_incomplete_event_size bounds an incomplete head only: a complete head "
        "that arrives in one or two reads (here ~70 KiB; up to ~128 KiB on loopback) is "
        "served",
    )
    assert_refused(served, padded_head(70 * 1024))


def test_unending_head_is_refused(served: Served) -> None:
    """~70 KiB of header lines, and no end of the head in sight."""
    head = padded_head(70 * 1024)
    assert_refused(served, head[: -len(b"\r\n")])


def test_head_under_the_limit_is_served(served: Served) -> None:
    with Conn(served.port) as conn:
        conn.send(padded_head(60 * 1024))
        answer = conn.read_response()
    assert (answer.status, answer.body) == (200, b"ok")


def test_large_body_behind_a_small_head_is_served(served: Served) -> None:
    """The head limit is the head's: a body (here 512 KiB) read at once with its head
    does not count towards it. (So that the server reads them at once whatever the load,
    it is sent while another request holds the server's event loop.)"""
    size = 512 * 1024
    head = b"POST /stream HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size
    with Conn(served.port) as holder, Conn(served.port) as conn:
        holder.send(get("/hold"))
        holder.wait_for(b"\r\n\r\n")  # the loop is held from now on, for HOLD_S
        conn.send(head + b"b" * size)
        answer = conn.read_response()
        held = holder.read_response()
    assert (held.status, held.body) == (200, b"ok")
    assert (answer.status, answer.body) == (200, stream_body(size))


def test_protocol_picks_the_implementation() -> None:
    assert issubclass(protocol(Settings(http="httptools")), HttpToolsProtocol)
    assert issubclass(protocol(Settings(http="h11")), H11Protocol)
    with pytest.raises(ValueError, match="LASTEVENT_HTTP"):
        protocol(Settings(http="bogus"))
