"""The API side of a request: validate, submit (log + queue), read back as SSE or JSON."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import AsyncIterator, Sequence

from redis.asyncio import Redis

from service.db.ledger import Ledger
from service.errors import InvalidRequest
from service.metrics import READERS
from service.queue import Job, RequestQueue
from service.redis_log import RedisLog
from service.settings import Settings
from service.stream import sse
from service.stream.events import Created, End, Kind
from service.stream.ids import Cursor, EventId, frame_ids, frames_to_skip
from service.stream.render import ChunkRenderer, ResponseAggregate
from service.tail import LogTailer
from service.tokenize import ModelInfo

MAX_STOP_STRINGS = 4
MAX_STOP_LEN = 64


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


async def submit(ctx: Context, sub: Submission, model_name: str) -> tuple[str, Created]:
    """Create the log (``created`` event), then enqueue the job."""
    rid = new_request_id(sub.kind)
    created = Created(
        kind=str(sub.kind),
        model=model_name,
        created=int(time.time()),
        prompt_tokens=len(sub.prompt_token_ids),
        include_usage=sub.include_usage,
    )
    settings = ctx.settings
    safety_ttl_s = int(settings.hot_log_ttl_s + 2 * settings.request_deadline_s)
    await ctx.log.create(rid, created, safety_ttl_s)
    deadline = time.time() + settings.request_deadline_s
    await ctx.queue.enqueue(
        Job(
            request_id=rid,
            prompt_token_ids=sub.prompt_token_ids,
            max_tokens=sub.max_tokens,
            temperature=sub.temperature,
            top_p=sub.top_p,
            seed=sub.seed,
            stop=sub.stop,
            deadline_unix_s=deadline,
        )
    )
    return rid, created


def _before(cursor: Cursor | None) -> EventId | None:
    """Where the tail must start so that a partly delivered event is read again."""
    if cursor is None:
        return None
    if cursor.frame is None:
        return cursor.event
    e = cursor.event
    return EventId(e.ms, e.seq - 1) if e.seq > 0 else EventId(e.ms - 1, 2**64 - 1)


async def sse_frames(
    ctx: Context, rid: str, created: Created, cursor: Cursor | None = None
) -> AsyncIterator[bytes]:
    """The request's log as SSE bytes, from ``cursor`` on, until its terminal event."""
    renderer = ChunkRenderer(rid, created)
    sub = ctx.tailer.subscribe(rid, _before(cursor))
    READERS.inc()
    keepalive_s = ctx.settings.keepalive_s
    try:
        while True:
            try:
                batch = await asyncio.wait_for(sub.queue.get(), keepalive_s)
            except TimeoutError:
                yield sse.KEEPALIVE
                continue
            if isinstance(batch, BaseException):
                raise batch
            out: list[bytes] = []
            ended = False
            for eid, event in batch:
                skip = frames_to_skip(cursor, eid)
                if skip is not None:
                    payloads = renderer.render(event)
                    ids = frame_ids(eid, len(payloads))
                    frames = [sse.frame(p, str(i)) for p, i in zip(payloads, ids, strict=True)]
                    out.extend(frames[skip:])
                if isinstance(event, End):
                    ended = True
                    break
            if out:
                yield b"".join(out)
            if ended:
                return
    finally:
        sub.close()
        READERS.dec()


async def collect(ctx: Context, rid: str, created: Created) -> ResponseAggregate:
    """Wait for the whole answer (a non-streaming client)."""
    agg = ResponseAggregate(rid, created)
    sub = ctx.tailer.subscribe(rid, None)
    READERS.inc()
    try:
        async for batch in sub.batches():
            for _eid, event in batch:
                agg.add(event)
                if isinstance(event, End):
                    return agg
    finally:
        sub.close()
        READERS.dec()
    return agg
