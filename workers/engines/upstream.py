"""The upstream engine: an OpenAI-compatible server the team already runs does the work
(``LASTEVENT_ENGINE=upstream``, ``LASTEVENT_UPSTREAM_URL``), and this worker turns its
stream into the request's log exactly as for an in-process engine.

Token mode (vLLM's server; ``upstream_wire``): the prompt goes as the ids lastevent's own
template made, and the server says which ids it made, so the runner detokenizes, holds
back stop strings, parses tool calls and counts usage from the ids, as for any engine --
and a request another worker started is continued from its logged ids (greedy-exact).

One HTTP connection pool (``httpx``, keep-alive) for every request. An abort closes the
request's stream: vLLM's server aborts a request whose client went away. Faults: a
refused connection, a 408/429/5xx (``Retry-After`` honoured), a stream cut mid-answer
and a stream that says nothing for ``idle_timeout_s`` are tried again -- from where the
answer is, the ids made so far added to the prompt -- for up to ``retry_s`` without
progress; then the request ends in band with the fault's code (``upstream_wire``). Where
the answer cannot be continued exactly (the presence or frequency penalty, structured
output: the server would count those ids as prompt), a fault after the first id ends it.

Several URLs (one model's replicas) share the requests, fewest running first; one that
refuses connections is left out until its ``/models`` answers again, and while none
does, ``available`` is False: the worker stops claiming and its heartbeat offers no
slots, rather than fail every job.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from typing import Any

import httpx
import msgspec
from httpx_sse import EventSource

from service.stream.lifecycle import EngineFinish
from service.stream.params import SamplingParams
from workers.engines import upstream_wire as wire
from workers.engines.base import EngineError, StepOutput, refuse_images

log = logging.getLogger(__name__)

_json = msgspec.json.Decoder()
_ABORTED = StepOutput([], finished=True, finish_reason=EngineFinish.ABORT)


@dataclasses.dataclass(frozen=True, slots=True)
class UpstreamConfig:
    urls: tuple[str, ...]  # base URLs ending in /v1: replicas of one model
    model: str  # the name the upstream serves
    # these three: Settings' upstream_*
    idle_timeout_s: float  # no chunk this long, once it sent one: the stream is hung
    # no chunk this long from the start: hung too (a busy server queues a request: it is
    # not asked again for waiting its turn)
    first_token_timeout_s: float
    retry_s: float  # how long a request tries again without progress
    api_key: str | None = None
    eos_token_ids: tuple[int, ...] = ()
    connect_timeout_s: float = 5.0
    max_connections: int = 1024
    probe_s: float = 1.0  # how often a replica that refused connections is asked again

    @classmethod
    def parse_urls(cls, spec: str) -> tuple[str, ...]:
        urls = tuple(u.strip().rstrip("/") for u in spec.split(",") if u.strip())
        for url in urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"LASTEVENT_UPSTREAM_URL: {url!r} is not an http(s) URL")
        if not urls:
            raise ValueError("LASTEVENT_UPSTREAM_URL is not set (the server's base URL, .../v1)")
        return urls


@dataclasses.dataclass(slots=True)
class _Replica:
    url: str
    up: bool = True
    running: int = 0


class _Retry(Exception):
    """A call failed in a way worth trying again (``after``: the server's Retry-After)."""

    def __init__(self, code: str, message: str, after: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.after = after


@dataclasses.dataclass(slots=True)
class _Live:
    """One running request: its open stream (an abort closes it, and so does the
    watchdog when it says nothing for too long: ``hung``)."""

    aborted: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    response: httpx.Response | None = None
    heard: float = 0.0  # monotonic s: the call's start, then its last chunk
    spoke: bool = False  # the call sent a chunk
    hung: bool = False


class UpstreamEngine:
    name = "upstream"
    continues = True
    images = False  # it takes no images (the API refuses them for its models)

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self.replicas = [_Replica(url) for url in config.urls]
        self._client: httpx.AsyncClient | None = None
        self._live: dict[str, _Live] = {}
        self._prober: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None

    @property
    def available(self) -> bool:
        """Some replica takes connections (False: the worker claims nothing)."""
        return any(r.up for r in self.replicas)

    async def start(self) -> None:
        c = self.config
        headers = {"Authorization": f"Bearer {c.api_key}"} if c.api_key else {}
        self._client = httpx.AsyncClient(
            headers=headers,
            # (silence mid-stream is the watchdog's: a read timeout per chunk would also
            # time out a request waiting its turn in a busy server's queue)
            timeout=httpx.Timeout(
                max(c.first_token_timeout_s, c.idle_timeout_s), connect=c.connect_timeout_s
            ),
            limits=httpx.Limits(
                max_connections=c.max_connections,
                max_keepalive_connections=c.max_connections,
            ),
        )
        for replica in self.replicas:
            await self._probe(replica, announce=True)
        self._prober = asyncio.create_task(self._probe_loop(), name="upstream-probe")
        self._watchdog = asyncio.create_task(self._watch(), name="upstream-watchdog")

    async def close(self) -> None:
        for task in (self._prober, self._watchdog):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def abort(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None:
            return
        live.aborted.set()
        if live.response is not None:  # the server aborts a request whose client left
            await live.response.aclose()

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generated: Sequence[int] = (),
        *,
        adapter: str | None = None,
        conversation: bytes = b"",
        images: Sequence[bytes] = (),
    ) -> AsyncGenerator[StepOutput, None]:
        refuse_images(self.name, images)
        if self._client is None:
            raise EngineError("the upstream engine is not started", "engine_not_ready")
        if not wire.continuable(params, generated):
            raise EngineError(
                "the upstream cannot continue a request under the presence or frequency "
                "penalty or structured output (it would count the ids made so far as prompt)",
                "unsupported_continuation",
            )
        live = self._live[request_id] = _Live()
        model = adapter or self.config.model
        try:
            steps = self._steps(
                live, model, prompt_token_ids, params, list(generated), conversation
            )
            async for step in steps:
                yield step
        finally:
            self._live.pop(request_id, None)

    def _request(
        self,
        model: str,
        prompt: list[int],
        made: list[int],
        params: SamplingParams,
        left: int,
        _: bytes,
    ) -> tuple[str, dict[str, Any], wire.Reader]:
        """The next call: its path, its body, and the reader of its chunks."""
        body = wire.token_body(
            model, [*prompt, *made], params, left, len(made), self.config.eos_token_ids
        )
        return "/completions", body, wire.TokenReader(params)

    def _goes_on(self, params: SamplingParams, made: list[int], first: int, sent: int) -> bool:
        """Whether a failed answer may be asked again from where it is: from the start,
        always; from ids it made, where the server continues them exactly."""
        return len(made) == first or wire.continuable(params, made)

    async def _steps(
        self,
        live: _Live,
        model: str,
        prompt: list[int],
        params: SamplingParams,
        made: list[int],
        conversation: bytes,
    ) -> AsyncIterator[StepOutput]:
        """The answer, tried again where a call fails; ``made``: the ids made so far."""
        first = len(made)  # ids made before this worker: continued as any others
        sent = 0  # steps with output yielded
        give_up_at: float | None = None
        backoff = 0.05
        while True:
            left = params.max_tokens - len(made)
            if left <= 0:
                yield StepOutput([], finished=True, finish_reason=EngineFinish.LENGTH)
                return
            path, body, reader = self._request(model, prompt, made, params, left, conversation)
            progressed = False
            try:
                async for step in self._call(live, path, body, reader):
                    made.extend(step.token_ids)
                    progressed = True
                    sent += bool(step.token_ids or step.text)
                    yield step
                    if step.finished:
                        return
                raise _Retry(wire.CUT, "the upstream's stream ended before the answer did")
            except _Retry as exc:
                if live.aborted.is_set():
                    yield _ABORTED
                    return
                if not self._goes_on(params, made, first, sent):
                    raise EngineError(f"{exc} (it cannot be continued exactly)", exc.code) from None
                now = time.monotonic()
                if progressed or give_up_at is None:
                    give_up_at, backoff = now + self.config.retry_s, 0.05
                # (the backoff at least: a Retry-After of 0 must not make a busy loop)
                wait = backoff if exc.after is None else max(exc.after, backoff)
                backoff = min(backoff * 2, 2.0)
                if now + wait > give_up_at:
                    raise EngineError(f"{exc} (for {self.config.retry_s:g} s)", exc.code) from None
                log.info("the upstream call failed (%s); again in %.2f s", exc, wait)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(live.aborted.wait(), wait)
                if live.aborted.is_set():
                    yield _ABORTED
                    return

    async def _call(
        self, live: _Live, path: str, body: dict[str, Any], reader: wire.Reader
    ) -> AsyncIterator[StepOutput]:
        """One streamed call on the replica with the fewest running."""
        assert self._client is not None
        replica = min(self.replicas, key=lambda r: (not r.up, r.running))
        replica.running += 1
        try:
            live.heard, live.spoke, live.hung = time.monotonic(), False, False
            request = self._client.build_request("POST", f"{replica.url}{path}", json=body)
            # its head: a server that lives sends it at once, busy or not (vLLM's does)
            async with asyncio.timeout(self.config.idle_timeout_s):
                response = await self._client.send(request, stream=True)
            try:
                live.response = response
                if live.aborted.is_set():
                    return
                if response.status_code != 200:
                    raise await _refused(response)
                async for event in EventSource(response).aiter_sse():
                    live.heard, live.spoke = time.monotonic(), True
                    if event.data == "[DONE]":
                        break
                    for step in reader.feed(_json.decode(event.data)):
                        yield step
                if live.hung:  # (closed by the watchdog: not the server's end)
                    raise _Retry(wire.TIMEOUT, f"{replica.url} sent nothing for a while")
                for step in reader.end():
                    yield step
            finally:
                await response.aclose()
        except Exception as exc:
            fault = self._fault(replica, live, exc)
            if fault is exc:
                raise
            raise fault from exc
        finally:
            live.response = None
            replica.running -= 1

    def _fault(self, replica: _Replica, live: _Live, exc: Exception) -> Exception:
        """What a failed call means: a ``_Retry`` with its code, or the error itself."""
        if live.hung or isinstance(exc, httpx.ReadTimeout | TimeoutError):  # (hung: see _watch)
            return _Retry(wire.TIMEOUT, f"{replica.url} sent nothing for a while")
        if live.aborted.is_set():  # (its stream closed under the read: whatever it raised)
            return _Retry(wire.CUT, "aborted")
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout):
            self._down(replica, exc)
            return _Retry(wire.UNAVAILABLE, f"{replica.url} refused the connection: {exc}")
        if isinstance(exc, httpx.TransportError | httpx.StreamError):
            return _Retry(wire.CUT, f"{replica.url}'s stream broke: {exc!r}")
        if isinstance(exc, msgspec.DecodeError):
            return EngineError(f"{replica.url} sent a chunk that is not JSON", wire.FAILED)
        return exc

    async def _watch(self) -> None:
        """Close the stream of every request whose server said nothing for too long
        (its read then fails, and the request is asked again from where it is); one
        timestamp per chunk on the hot path, no timer per read."""
        c = self.config
        while True:
            await asyncio.sleep(min(0.5, c.idle_timeout_s / 4))
            now = time.monotonic()
            for live in list(self._live.values()):
                limit = c.idle_timeout_s if live.spoke else c.first_token_timeout_s
                response = live.response
                if response is not None and not live.hung and now - live.heard > limit:
                    live.hung = True
                    await response.aclose()

    def _down(self, replica: _Replica, exc: Exception) -> None:
        if replica.up:
            log.warning("the upstream %s refuses connections (%s): left out", replica.url, exc)
        replica.up = False

    async def _probe_loop(self) -> None:
        """Every replica, every ``probe_s``: one that went away is seen while the worker
        is idle too (it then claims nothing), not only by the next request it fails."""
        while True:
            await asyncio.sleep(self.config.probe_s)
            await asyncio.gather(*(self._probe(r) for r in self.replicas))

    async def _probe(self, replica: _Replica, *, announce: bool = False) -> None:
        """Ask ``/models``: up when it answers (any status), down when it refuses the
        connection; a slow answer changes nothing (busy is not down)."""
        assert self._client is not None
        try:
            response = await self._client.get(f"{replica.url}/models", timeout=5.0)
        except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
            self._down(replica, exc)
            return
        except httpx.HTTPError as exc:
            if announce:  # (at start: not known to be up)
                self._down(replica, exc)
            return
        if not replica.up:
            log.info("the upstream %s answers again", replica.url)
        replica.up = True
        if announce:
            _check_model(replica.url, response, self.config.model)


async def _refused(response: httpx.Response) -> Exception:
    """What a non-200 answer means: try again (busy, starting) or the request's error."""
    body = await response.aread()
    status = response.status_code
    if status in wire.RETRY_STATUS:
        after = wire.retry_after(response.headers)
        return _Retry(wire.UNAVAILABLE, f"the upstream answered {status}", after)
    return wire.refusal(status, body)


def _check_model(url: str, response: httpx.Response, model: str) -> None:
    """Say so when the upstream's ``/models`` does not list the model (a router may serve
    it anyway: not an error)."""
    try:
        names = [m.get("id") for m in response.json().get("data", [])]
    except Exception:  # noqa: BLE001 - a server whose /models says nothing readable
        return
    if model not in names:
        log.warning("the upstream %s lists %s, not %r", url, names[:8], model)
