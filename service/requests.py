"""The API side of a request: validate, submit (log + queue), read back as SSE or JSON."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis.asyncio import Redis

from service.admission import Admission, who
from service.auth import KeyStore, Principal
from service.control import Control, Lease, Presence
from service.db.ledger import Ledger
from service.errors import InvalidRequest
from service.metrics import READERS
from service.queue import Job, RequestQueue, encode_job
from service.redis_log import RedisLog
from service.settings import Settings
from service.stream import sse
from service.stream.events import Created, Delta, End, Event, Kind
from service.stream.ids import Cursor, EventId
from service.stream.render import (
    ChunkRenderer,
    ResponseAggregate,
    coalesce,
    sse_event_frames,
    usage,
)
from service.tail import IDLE, Interrupted, LogTailer
from service.tokenize import ModelInfo

log = logging.getLogger(__name__)

MAX_STOP_STRINGS = 4
MAX_STOP_LEN = 64


class Drain:
    """Set when the API process starts to shut down: readers tell their clients to
    reconnect (elsewhere) and close, so the process can exit within its drain time."""

    def __init__(self) -> None:
        self._loop: asyncio.AbstractEventLoop | None = None
        self.future: asyncio.Future[None] | None = None  # one for all readers: no task each

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.future = loop.create_future()

    def start(self) -> None:
        """Safe to call from a signal handler."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._set)

    def _set(self) -> None:
        if self.future is not None and not self.future.done():
            self.future.set_result(None)

    @property
    def draining(self) -> bool:
        return self.future is not None and self.future.done()


@dataclasses.dataclass(slots=True)
class Context:
    """Everything a handler needs; built once in the app's lifespan."""

    settings: Settings
    redis: Redis
    log: RedisLog
    queue: RequestQueue
    tailer: LogTailer
    model: ModelInfo
    ledger: Ledger | None
    control: Control
    presence: Presence
    keys: KeyStore | None
    admission: Admission
    drain: Drain


@dataclasses.dataclass(frozen=True, slots=True)
class Submission:
    kind: Kind
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: list[str]
    include_usage: bool
    resume_grace_s: float
    detached: bool


def new_request_id(kind: Kind) -> str:
    """Unguessable: 128 random bits."""
    return ("chatcmpl-" if kind == Kind.CHAT else "cmpl-") + secrets.token_hex(16)


def check_stop(stop: str | Sequence[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed",
            param="stop",
            code="invalid_stop",
        )
    for s in stops:
        if not s:
            raise InvalidRequest("'stop' strings must not be empty", param="stop")
        if len(s) > MAX_STOP_LEN:
            raise InvalidRequest(
                f"'stop' string of {len(s)} characters; at most {MAX_STOP_LEN} are allowed",
                param="stop",
                code="invalid_stop",
            )
    return stops


def check_max_tokens(requested: int | None, prompt_tokens: int, settings: Settings, ctx_len: int) -> int:
    room = ctx_len - prompt_tokens
    if room <= 0:
        raise InvalidRequest(
            f"the prompt has {prompt_tokens} tokens; the model's context length is {ctx_len}",
            param="messages",
            code="context_length_exceeded",
        )
    if requested is None:
        return min(room, settings.default_max_tokens)
    if requested > room:
        raise InvalidRequest(
            f"max_tokens is {requested} but the prompt has {prompt_tokens} tokens and the "
            f"model's context length is {ctx_len} (at most {room} tokens can be generated)",
            param="max_tokens",
            code="context_length_exceeded",
        )
    return requested


async def submit(
    ctx: Context, sub: Submission, model_name: str, principal: Principal
) -> tuple[str, Created, Lease]:
    """Create the log (``created`` event), take the caller's reader lease, enqueue the job.

    The lease exists before any worker can see the job, so a worker never mistakes a
    request whose client is still connecting for an abandoned one."""
    rid = new_request_id(sub.kind)
    await ctx.admission.check_capacity(len(ctx.presence))
    await ctx.admission.admit(who(principal.tenant, principal.key_id), rid)
    created = Created(
        kind=str(sub.kind),
        model=model_name,
        created=int(time.time()),
        prompt_tokens=len(sub.prompt_token_ids),
        include_usage=sub.include_usage,
        tenant=principal.tenant,
        api_key_id=principal.key_id,
    )
    settings = ctx.settings
    safety_ttl_s = int(settings.hot_log_ttl_s + 2 * settings.request_deadline_s)
    job = Job(
        request_id=rid,
        prompt_token_ids=sub.prompt_token_ids,
        max_tokens=sub.max_tokens,
        temperature=sub.temperature,
        top_p=sub.top_p,
        seed=sub.seed,
        stop=sub.stop,
        deadline_unix_s=time.time() + settings.request_deadline_s,
    )
    # the log, the caller's reader lease and the job: one script, one round trip (each
    # await is a turn of a busy event loop: five of them made a burst of starts slow)
    lease = ctx.presence.track(rid, adopted=False)
    try:
        await ctx.log.create(
            rid,
            created,
            safety_ttl_s,
            grace_ms=int(sub.resume_grace_s * 1000),
            detached=sub.detached,
            lease=(lease.token, ctx.presence.expiry_ms()),
            job=encode_job(job),
        )
    except BaseException:
        ctx.presence.forget(lease)
        raise
    return rid, created, lease


def _before(cursor: Cursor | None) -> EventId | None:
    """Where the tail must start so that a partly delivered event is read again."""
    if cursor is None:
        return None
    if cursor.frame is None:
        return cursor.event
    e = cursor.event
    return EventId(e.ms, e.seq - 1) if e.seq > 0 else EventId(e.ms - 1, 2**64 - 1)


async def sse_frames(
    ctx: Context,
    rid: str,
    created: Created,
    cursor: Cursor | None = None,
    lease: Lease | None = None,
) -> AsyncIterator[bytes]:
    """The request's log as SSE bytes, from ``cursor`` on, until its terminal event.

    The reader holds a presence lease for as long as it is connected."""
    renderer = ChunkRenderer(rid, created)
    # subscribe first: the tailer starts reading while the lease is written
    sub = ctx.tailer.subscribe(rid, _before(cursor), interruptible=True)
    if lease is None:  # a (re)connecting reader: read what the log holds meanwhile, rather
        # than wait for the tailer's wake and next read (the resume latency a client feels)
        reading = asyncio.ensure_future(ctx.log.read(rid, _before(cursor)))
        try:
            lease = await ctx.presence.acquire(rid)
        except BaseException:
            reading.cancel()
            sub.close()
            raise
        try:
            sub.offer(await reading)
        except BaseException:
            sub.close()
            await lease.release()
            raise
    lease.adopted = True
    READERS.inc()
    try:
        while True:
            batch = await sub.queue.get()  # no timer per wait: the tailer's ticker sends IDLE
            if batch is IDLE:
                yield sse.KEEPALIVE
                continue
            if isinstance(batch, Interrupted):  # shutting down: reconnect elsewhere
                yield sse.retry(ctx.settings.reconnect_hint_ms)
                return
            if isinstance(batch, BaseException):
                raise batch
            if sub.queue.qsize() >= ctx.settings.coalesce_backlog:
                # this reader fell behind (its client reads slowly): take everything
                # waiting and send runs of deltas as one event each
                while not sub.queue.empty():
                    more = sub.queue.get_nowait()
                    if more is IDLE:
                        continue
                    if isinstance(more, BaseException):  # send what we have first
                        sub.queue.unget(more)
                        break
                    batch = batch + more
                batch = coalesce(batch)
            out: list[bytes] = []
            ended = False
            delivered = lease.delivered
            for eid, event in batch:
                if isinstance(event, Delta):
                    delivered = max(delivered, event.n)
                out.extend(sse_event_frames(renderer, eid, event, cursor))
                if isinstance(event, End):
                    ended = True
                    await ctx.admission.release(who(created.tenant, created.api_key_id), rid)
                    break
            if out:
                yield b"".join(out)
            lease.delivered = delivered  # the send completed: it reached the connection
            if ended:
                return
    finally:
        sub.close()
        READERS.dec()
        await lease.release()


async def collect(ctx: Context, rid: str, created: Created, lease: Lease) -> ResponseAggregate:
    """Wait for the whole answer (a non-streaming client, holding ``lease`` meanwhile)."""
    agg = ResponseAggregate(rid, created)
    lease.adopted = True
    sub = ctx.tailer.subscribe(rid, None)
    READERS.inc()
    try:
        async for batch in sub.batches():
            for _eid, event in batch:
                agg.add(event)
                if isinstance(event, End):
                    lease.delivered = event.completion_tokens
                    await ctx.admission.release(who(created.tenant, created.api_key_id), rid)
                    return agg
    finally:
        sub.close()
        READERS.dec()
        await lease.release()
    return agg


async def request_status(ctx: Context, rid: str) -> dict[str, Any] | None:
    """State, finish_reason, usage and last event id: from the hot log, else the ledger."""
    meta = await ctx.log.meta(rid)
    if meta is not None:
        created = await ctx.log.first(rid)
        last = await ctx.log.last(rid)
        end = last[1] if last is not None and isinstance(last[1], End) else None
        return {
            "id": rid,
            "object": "request",
            "tenant": created.tenant if created else None,
            "state": meta.state,
            "model": created.model if created else None,
            "created": created.created if created else None,
            "finish_reason": end.finish_reason if end else None,
            "usage": usage(end) if end else None,
            "last_event_id": meta.last_event_id,
        }
    row = await ctx.ledger.get(rid) if ctx.ledger is not None else None
    if row is None:
        return None
    return {
        "id": row.id,
        "object": "request",
        "tenant": row.tenant,
        "state": row.state,
        "model": row.model,
        "created": int(row.created_at.timestamp()),
        "finish_reason": row.finish_reason,
        "usage": {
            "prompt_tokens": row.prompt_tokens,
            "completion_tokens": row.completion_tokens,
            "total_tokens": row.total_tokens,
        },
        "last_event_id": row.last_event_id,
    }


async def cold_frames(
    rid: str, entries: list[tuple[EventId, Event]], cursor: Cursor | None
) -> AsyncIterator[bytes]:
    """An archived log as SSE: the same ids and bytes the hot log gave."""
    created = entries[0][1]
    assert isinstance(created, Created)
    renderer = ChunkRenderer(rid, created)
    out: list[bytes] = []
    for eid, event in entries:
        out.extend(sse_event_frames(renderer, eid, event, cursor))
    if out:
        yield b"".join(out)


async def authenticate(ctx: Context, authorization: str | None) -> Principal:
    """The caller, from ``Authorization: Bearer sk-le-...``."""
    from service.auth import ANONYMOUS, parse_key
    from service.errors import Unauthorized

    raw = (authorization or "").strip()
    if raw.lower().startswith("bearer "):
        raw = raw[7:].strip()
    if ctx.settings.auth == "off" and parse_key(raw) is None:
        return ANONYMOUS  # SDKs insist on some api_key; with auth off, only real keys count
    if not raw:
        raise Unauthorized(
            "no API key: send 'Authorization: Bearer sk-le-...'", code="missing_api_key"
        )
    if ctx.keys is None:
        raise Unauthorized("API keys need a database (LASTEVENT_DATABASE_URL)", code="no_key_store")
    principal = await ctx.keys.verify(raw)
    if principal is None:
        raise Unauthorized("the API key is not valid", code="invalid_api_key")
    return principal
