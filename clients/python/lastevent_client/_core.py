"""The resume protocol without I/O: what to send next, what a response and an event mean,
and how long to wait before the next connection. ``Client`` and ``AsyncClient`` drive it.

SSE parsing is httpx-sse's: its decoder hands over an event only once the blank line
that ends it has arrived, so an event cut in half by a broken connection is never seen,
and the id kept for the next connection is always the id of a whole event.
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

from httpx_sse import ServerSentEvent

# statuses worth another try (the server says so, or a proxy in between failed)
RETRYABLE = frozenset({408, 425, 429, 500, 502, 503, 504})

READ = "read"  # a 200: read its events
RETRY = "retry"  # a status worth another try
DONE = "done"  # a 204: nothing more to read


class LastEventError(Exception):
    """An error the server reported (in band, or as an HTTP status), or a stream that
    could not be resumed within the reconnect budget (``code == "connection_lost"``)."""

    def __init__(
        self,
        code: str,
        message: str,
        *,
        status: int | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.status = status
        self.request_id = request_id


@dataclasses.dataclass(frozen=True)
class Backoff:
    """When to reconnect: ``retry`` (the server's ``retry:`` hint, else ``default_retry_ms``)
    times 2**(failures - 1), times 1..1+jitter, capped at ``max_delay_s`` but never below
    the hint or a ``Retry-After``. ``max_reconnects`` connections in a row that bring no
    new event give up with ``LastEventError("connection_lost")``."""

    max_reconnects: int = 10
    max_delay_s: float = 30.0
    default_retry_ms: int = 1000
    jitter: float = 0.5


@dataclasses.dataclass(frozen=True)
class Call:
    method: str
    path: str
    headers: dict[str, str]
    params: dict[str, str]
    json: dict[str, Any] | None


def error_of(body: bytes | None, status: int) -> tuple[str, str]:
    """``(code, message)`` of an OpenAI-style error body, whatever the body is."""
    try:
        err = json.loads(body or b"")["error"]
        return str(err.get("code") or err.get("type") or status), str(err.get("message") or "")
    except (ValueError, TypeError, KeyError, AttributeError):
        return str(status), (body or b"").decode("utf-8", "replace")[:500]


def _retry_after(headers: Mapping[str, str]) -> float | None:
    raw = headers.get("retry-after")
    try:
        return max(0.0, float(raw)) if raw is not None else None
    except ValueError:
        return None


def text_of(chunk: Mapping[str, Any]) -> str:
    """The text a chat or text-completion chunk adds."""
    out = []
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta")
        if isinstance(delta, Mapping):
            out.append(delta.get("content") or "")
        else:
            out.append(choice.get("text") or "")
    return "".join(out)


class StreamState:
    """One answer's stream across all the connections it takes."""

    def __init__(
        self,
        *,
        path: str,
        body: dict[str, Any] | None,
        api_key: str | None,
        idempotency_key: str | None,
        backoff: Backoff,
        rng: random.Random,
        request_id: str | None = None,
        last_event_id: str | None = None,
        token: str | None = None,
    ) -> None:
        self.path = path
        self.body = body
        self.api_key = api_key
        self.idempotency_key = idempotency_key
        self.backoff = backoff
        self.rng = rng
        self.request_id = request_id
        self.last_event_id = last_event_id
        self.stream_token = token
        self.attempts = 0  # connections made (POSTs and GETs)
        self.failures = 0  # connections in a row that brought no new event
        self.retry_ms: int | None = None  # the server's last `retry:`
        self.done = False
        self.cancelled = False
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] | None = None
        self.last_problem = ""
        self._retry_after: float | None = None
        # whether a usage chunk follows the finish (None: not known, wait for [DONE])
        if body is None:
            self._want_usage: bool | None = None
        else:
            options = body.get("stream_options") or {}
            self._want_usage = bool(isinstance(options, Mapping) and options.get("include_usage"))

    @property
    def reconnects(self) -> int:
        return max(0, self.attempts - 1)

    def stopped(self) -> bool:
        return self.done or self.cancelled

    def is_cancelled(self) -> bool:
        return self.cancelled

    def next_call(self) -> Call:
        self.attempts += 1
        headers = {"Accept": "text/event-stream"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        if self.request_id is None:  # not yet accepted: (re)send the POST, same key
            assert self.body is not None and self.idempotency_key is not None
            headers["Idempotency-Key"] = self.idempotency_key
            return Call("POST", self.path, headers, {}, self.body)
        params: dict[str, str] = {}
        if not self.api_key and self.stream_token:
            params["token"] = self.stream_token
        if self.last_event_id:
            headers["Last-Event-ID"] = self.last_event_id
        path = f"/v1/requests/{quote(self.request_id, safe='')}/events"
        return Call("GET", path, headers, params, None)

    def on_response(self, status: int, headers: Mapping[str, str], body: bytes | None) -> str:
        """``READ``, ``RETRY`` or ``DONE``; raises ``LastEventError`` for a final refusal."""
        self._retry_after = None
        if status == 200:
            rid = headers.get("x-request-id")
            if self.request_id is None:
                if not rid:
                    raise LastEventError("protocol_error", "the 200 carries no X-Request-Id")
                self.request_id = rid
            token = headers.get("x-stream-token")
            if token:
                self.stream_token = token
            return READ
        if status == 204:  # past the terminal event: the client has it all
            self.done = True
            return DONE
        code, message = error_of(body, status)
        if status in RETRYABLE:
            self.failures += 1
            self._retry_after = _retry_after(headers)
            self.last_problem = f"{status} {code}: {message}"
            return RETRY
        raise LastEventError(code, message, status=status, request_id=self.request_id)

    def on_event(self, sse: ServerSentEvent) -> dict[str, Any] | None:
        """A whole event: the chunk it carries, or None (a hint, ``[DONE]``)."""
        if sse.retry is not None:
            self.retry_ms = sse.retry
        if sse.id:
            self.last_event_id = sse.id
        if not sse.data:
            return None
        self.failures = 0  # a new event: the connection was worth it
        if sse.data == "[DONE]":
            self.done = True
            return None
        try:
            chunk = json.loads(sse.data)
        except ValueError:
            raise LastEventError(
                "protocol_error", f"not JSON: {sse.data[:200]!r}", request_id=self.request_id
            ) from None
        if not isinstance(chunk, dict):
            raise LastEventError(
                "protocol_error", f"not an object: {sse.data[:200]!r}", request_id=self.request_id
            )
        err = chunk.get("error")
        if err is not None:
            self.done = True
            if not isinstance(err, Mapping):
                err = {"message": str(err)}
            raise LastEventError(
                str(err.get("code") or err.get("type") or "error"),
                str(err.get("message") or ""),
                request_id=self.request_id,
            )
        for choice in chunk.get("choices") or ():
            if isinstance(choice, Mapping) and choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        return chunk

    def _finished(self) -> bool:
        """The answer's end arrived, and everything after it that matters (the usage chunk
        if one was asked for); only ``[DONE]`` may be missing."""
        if self.finish_reason is None:
            return False
        return self._want_usage is False or self.usage is not None

    def on_broken(self, problem: BaseException | str) -> None:
        """The connection broke (or ended without the terminal event)."""
        self.last_problem = problem if isinstance(problem, str) else repr(problem)
        if self._finished():
            self.done = True
            return
        self.failures += 1

    def next_delay(self) -> float:
        """Seconds to wait before the next connection; raises when the budget is spent."""
        b = self.backoff
        if self.failures > b.max_reconnects:
            raise LastEventError(
                "connection_lost",
                f"{self.failures} connections in a row brought nothing new "
                f"(last: {self.last_problem})",
                request_id=self.request_id,
            )
        base = (self.retry_ms if self.retry_ms is not None else b.default_retry_ms) / 1000.0
        n = max(0, self.failures - 1)
        delay = min(b.max_delay_s, base * 2.0**n * (1.0 + b.jitter * self.rng.random()))
        return max(delay, base, self._retry_after or 0.0)
