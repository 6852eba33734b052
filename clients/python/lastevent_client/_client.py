"""``Client`` and ``AsyncClient``: the same protocol (``_core.StreamState``), two drivers."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Generator, Iterator
from types import TracebackType
from typing import Any
from urllib.parse import quote

import httpx
from httpx_sse import EventSource, SSEError

from lastevent_client._core import (
    READ,
    RETRYABLE,
    Backoff,
    LastEventError,
    StreamState,
    error_of,
    text_of,
)

DEFAULT_TIMEOUT = httpx.Timeout(connect=10.0, read=60.0, write=30.0, pool=30.0)
CHAT_PATH = "/v1/chat/completions"
TEXT_PATH = "/v1/completions"


def _root(base_url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1`` alike."""
    url = base_url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def _body(payload: dict[str, Any], params: dict[str, Any]) -> dict[str, Any]:
    return {**payload, **params, "stream": True}


def _protocol_error(exc: SSEError, state: StreamState) -> LastEventError:
    return LastEventError("protocol_error", str(exc), request_id=state.request_id)


class _Settings:
    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        backoff: Backoff,
        timeout: httpx.Timeout | float,
    ) -> None:
        self.base_url = _root(base_url)
        self.api_key = api_key
        self.backoff = backoff
        self.timeout = timeout
        self.rng = random.Random()

    def state(
        self,
        path: str,
        body: dict[str, Any] | None,
        *,
        idempotency_key: str | None = None,
        request_id: str | None = None,
        last_event_id: str | None = None,
        token: str | None = None,
    ) -> StreamState:
        if body is not None and idempotency_key is None:
            idempotency_key = uuid.uuid4().hex
        return StreamState(
            path=path,
            body=body,
            api_key=self.api_key,
            idempotency_key=idempotency_key,
            backoff=self.backoff,
            rng=self.rng,
            request_id=request_id,
            last_event_id=last_event_id,
            token=token,
        )

    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class _StreamInfo:
    _state: StreamState

    @property
    def request_id(self) -> str | None:
        """The request's id (``X-Request-Id``), once the server accepted it."""
        return self._state.request_id

    @property
    def last_event_id(self) -> str | None:
        """The id of the last whole event received: where a resume starts."""
        return self._state.last_event_id

    @property
    def stream_token(self) -> str | None:
        """The response's ``X-Stream-Token`` (reads this stream without an API key)."""
        return self._state.stream_token

    @property
    def idempotency_key(self) -> str | None:
        return self._state.idempotency_key

    @property
    def reconnects(self) -> int:
        """Connections made after the first (re-sent POSTs and resumes)."""
        return self._state.reconnects

    @property
    def retry_ms(self) -> int | None:
        """The server's last ``retry:`` hint (the base of the reconnect backoff)."""
        return self._state.retry_ms

    @property
    def finish_reason(self) -> str | None:
        return self._state.finish_reason

    @property
    def usage(self) -> dict[str, Any] | None:
        return self._state.usage

    @property
    def done(self) -> bool:
        return self._state.done


# ----------------------------------------------------------------------------- sync


class Stream(_StreamInfo):
    """An answer's text deltas (``str``), across as many connections as it takes.

    Iterate it for the text; ``chunks()`` gives the OpenAI chunk objects (dicts) instead,
    from the same stream. Nothing is sent before the iteration starts."""

    def __init__(self, client: Client, state: StreamState) -> None:
        self._client = client
        self._state = state
        self._chunks = self._drive()

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        while True:
            text = text_of(next(self._chunks))
            if text:
                return text

    def chunks(self) -> Iterator[dict[str, Any]]:
        return self._chunks

    def text(self) -> str:
        """Read the rest of the answer and return it."""
        return "".join(self)

    def cancel(self) -> dict[str, Any] | None:
        """Cancel the request on the server and stop this stream (from any thread).
        Returns the request's status, or None if it was not accepted yet (it is
        cancelled as soon as it is)."""
        self._state.cancelled = True
        rid = self._state.request_id
        return self._client.cancel(rid) if rid is not None else None

    def close(self) -> None:
        """Stop reading (the request goes on on the server; ``resume`` picks it up)."""
        self._chunks.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _drive(self) -> Generator[dict[str, Any], None, None]:
        st = self._state
        http = self._client.http
        while not st.stopped():
            call = st.next_call()
            try:
                with http.stream(
                    call.method,
                    call.path,
                    headers=call.headers,
                    params=call.params,
                    json=call.json,
                ) as r:
                    body = None if r.status_code in (200, 204) else r.read()
                    if st.on_response(r.status_code, r.headers, body) == READ:
                        if st.is_cancelled():  # cancelled while the POST was on its way
                            self._client.cancel(st.request_id or "")
                            return
                        for sse in EventSource(r).iter_sse():
                            chunk = st.on_event(sse)
                            if st.is_cancelled():
                                return
                            if chunk is not None:
                                yield chunk
                            if st.stopped():
                                return
                        st.on_broken("the stream ended before its terminal event")
            except httpx.TransportError as exc:
                st.on_broken(exc)
            except SSEError as exc:
                raise _protocol_error(exc, st) from exc
            if st.stopped():
                return
            time.sleep(st.next_delay())


class _SyncKind:
    def __init__(self, client: Client, path: str, field: str) -> None:
        self._client, self._path, self._field = client, path, field

    def _stream(self, model: str, value: Any, idempotency_key: str | None, **params: Any) -> Stream:
        body = _body({"model": model, self._field: value}, params)
        c = self._client
        return Stream(c, c.settings.state(self._path, body, idempotency_key=idempotency_key))


class _SyncChat(_SyncKind):
    def stream(
        self,
        *,
        model: str,
        messages: list[dict[str, Any]],
        idempotency_key: str | None = None,
        **params: Any,
    ) -> Stream:
        """POST /v1/chat/completions (streaming) with an Idempotency-Key (a new one unless
        given) and follow the answer to its end, resuming after every broken connection."""
        return self._stream(model, messages, idempotency_key, **params)


class _SyncCompletions(_SyncKind):
    def stream(
        self,
        *,
        model: str,
        prompt: str | list[int],
        idempotency_key: str | None = None,
        **params: Any,
    ) -> Stream:
        """POST /v1/completions (streaming), resumed the same way as ``chat.stream``."""
        return self._stream(model, prompt, idempotency_key, **params)


class Client:
    """A lastevent client whose streams survive broken connections.

    ``base_url`` is the server's root (``http://host:8000``; a trailing ``/v1`` is
    accepted too). ``api_key`` is sent as ``Authorization: Bearer``; without one, resumes
    authenticate with the response's ``X-Stream-Token``."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        backoff: Backoff | None = None,
    ) -> None:
        self.settings = _Settings(base_url, api_key, backoff or Backoff(), timeout)
        self.http = httpx.Client(base_url=self.settings.base_url, timeout=timeout)
        self.chat = _SyncChat(self, CHAT_PATH, "messages")
        self.completions = _SyncCompletions(self, TEXT_PATH, "prompt")

    def resume(
        self, request_id: str, last_event_id: str | None = None, *, token: str | None = None
    ) -> Stream:
        """Pick up a request's stream after ``last_event_id`` (from the start if None),
        authenticated by the API key or else by ``token`` (an ``X-Stream-Token``)."""
        return Stream(
            self,
            self.settings.state(
                "", None, request_id=request_id, last_event_id=last_event_id, token=token
            ),
        )

    def cancel(self, request_id: str) -> dict[str, Any]:
        """POST /v1/requests/{id}/cancel (idempotent: sent again after a broken
        connection); the request's status."""
        return self._call("POST", f"/v1/requests/{quote(request_id, safe='')}/cancel", {})

    def status(self, request_id: str, *, token: str | None = None) -> dict[str, Any]:
        """GET /v1/requests/{id}: state, finish_reason, usage."""
        params = {"token": token} if token and not self.settings.api_key else {}
        return self._call("GET", f"/v1/requests/{quote(request_id, safe='')}", params)

    def _call(self, method: str, path: str, params: dict[str, str]) -> dict[str, Any]:
        retries = _Retries(self.settings)
        while True:
            try:
                r = self.http.request(method, path, headers=self.settings.auth(), params=params)
            except httpx.TransportError as exc:
                time.sleep(retries.after(exc))
                continue
            if r.status_code in RETRYABLE:
                time.sleep(retries.after(r))
                continue
            return _json_or_raise(r, path)

    def close(self) -> None:
        self.http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _json_or_raise(r: httpx.Response, path: str) -> dict[str, Any]:
    if r.status_code >= 400:
        code, message = error_of(r.content, r.status_code)
        raise LastEventError(code, f"{message} ({path})", status=r.status_code)
    out: dict[str, Any] = r.json()
    return out


class _Retries:
    """The backoff of a plain call (cancel, status): both are safe to send again."""

    def __init__(self, settings: _Settings) -> None:
        self.settings = settings
        self.failures = 0

    def after(self, problem: httpx.Response | Exception) -> float:
        b = self.settings.backoff
        self.failures += 1
        if self.failures > b.max_reconnects:
            if isinstance(problem, Exception):
                raise LastEventError("connection_lost", repr(problem)) from problem
            code, message = error_of(problem.content, problem.status_code)
            raise LastEventError(code, message, status=problem.status_code)
        base = b.default_retry_ms / 1000.0
        delay = base * 2.0 ** (self.failures - 1) * (1 + b.jitter * self.settings.rng.random())
        hint = None
        if isinstance(problem, httpx.Response):
            hint = problem.headers.get("retry-after")
        try:
            floor = float(hint) if hint is not None else 0.0
        except ValueError:
            floor = 0.0
        return max(min(b.max_delay_s, delay), floor)


# ---------------------------------------------------------------------------- async


class AsyncStream(_StreamInfo):
    """``Stream`` for asyncio: ``async for text in stream``; ``chunks()`` for the dicts."""

    def __init__(self, client: AsyncClient, state: StreamState) -> None:
        self._client = client
        self._state = state
        self._chunks = self._drive()

    def __aiter__(self) -> AsyncIterator[str]:
        return self

    async def __anext__(self) -> str:
        while True:
            text = text_of(await self._chunks.__anext__())
            if text:
                return text

    def chunks(self) -> AsyncIterator[dict[str, Any]]:
        return self._chunks

    async def text(self) -> str:
        return "".join([t async for t in self])

    async def cancel(self) -> dict[str, Any] | None:
        self._state.cancelled = True
        rid = self._state.request_id
        return await self._client.cancel(rid) if rid is not None else None

    async def aclose(self) -> None:
        await self._chunks.aclose()

    async def __aenter__(self) -> AsyncStream:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _drive(self) -> AsyncGenerator[dict[str, Any], None]:
        st = self._state
        http = self._client.http
        while not st.stopped():
            call = st.next_call()
            try:
                async with http.stream(
                    call.method,
                    call.path,
                    headers=call.headers,
                    params=call.params,
                    json=call.json,
                ) as r:
                    body = None if r.status_code in (200, 204) else await r.aread()
                    if st.on_response(r.status_code, r.headers, body) == READ:
                        if st.is_cancelled():
                            await self._client.cancel(st.request_id or "")
                            return
                        events = EventSource(r).aiter_sse()
                        try:
                            async for sse in events:
                                chunk = st.on_event(sse)
                                if st.is_cancelled():
                                    return
                                if chunk is not None:
                                    yield chunk
                                if st.stopped():
                                    return
                        finally:
                            await events.aclose()
                        st.on_broken("the stream ended before its terminal event")
            except httpx.TransportError as exc:
                st.on_broken(exc)
            except SSEError as exc:
                raise _protocol_error(exc, st) from exc
            if st.stopped():
                return
            await asyncio.sleep(st.next_delay())


class _AsyncKind:
    def __init__(self, client: AsyncClient, path: str, field: str) -> None:
        self._client, self._path, self._field = client, path, field

    def _stream(
        self, model: str, value: Any, idempotency_key: str | None, **params: Any
    ) -> AsyncStream:
        body = _body({"model": model, self._field: value}, params)
        c = self._client
        return AsyncStream(c, c.settings.state(self._path, body, idempotency_key=idempotency_key))


class _AsyncChat(_AsyncKind):
    def stream(
        self,
        *,
        model: str,
        messages: list[dict[str, Any]],
        idempotency_key: str | None = None,
        **params: Any,
    ) -> AsyncStream:
        """``Client.chat.stream`` for asyncio (not a coroutine: iterate the result)."""
        return self._stream(model, messages, idempotency_key, **params)


class _AsyncCompletions(_AsyncKind):
    def stream(
        self,
        *,
        model: str,
        prompt: str | list[int],
        idempotency_key: str | None = None,
        **params: Any,
    ) -> AsyncStream:
        return self._stream(model, prompt, idempotency_key, **params)


class AsyncClient:
    """``Client`` for asyncio."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: httpx.Timeout | float = DEFAULT_TIMEOUT,
        backoff: Backoff | None = None,
    ) -> None:
        self.settings = _Settings(base_url, api_key, backoff or Backoff(), timeout)
        self.http = httpx.AsyncClient(base_url=self.settings.base_url, timeout=timeout)
        self.chat = _AsyncChat(self, CHAT_PATH, "messages")
        self.completions = _AsyncCompletions(self, TEXT_PATH, "prompt")

    def resume(
        self, request_id: str, last_event_id: str | None = None, *, token: str | None = None
    ) -> AsyncStream:
        return AsyncStream(
            self,
            self.settings.state(
                "", None, request_id=request_id, last_event_id=last_event_id, token=token
            ),
        )

    async def cancel(self, request_id: str) -> dict[str, Any]:
        return await self._call("POST", f"/v1/requests/{quote(request_id, safe='')}/cancel", {})

    async def status(self, request_id: str, *, token: str | None = None) -> dict[str, Any]:
        params = {"token": token} if token and not self.settings.api_key else {}
        return await self._call("GET", f"/v1/requests/{quote(request_id, safe='')}", params)

    async def _call(self, method: str, path: str, params: dict[str, str]) -> dict[str, Any]:
        retries = _Retries(self.settings)
        while True:
            try:
                r = await self.http.request(
                    method, path, headers=self.settings.auth(), params=params
                )
            except httpx.TransportError as exc:
                await asyncio.sleep(retries.after(exc))
                continue
            if r.status_code in RETRYABLE:
                await asyncio.sleep(retries.after(r))
                continue
            return _json_or_raise(r, path)

    async def aclose(self) -> None:
        await self.http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()
