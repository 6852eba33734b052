"""Readers: a request's log read back as SSE bytes, or collected into one JSON answer.

A reader holds a presence lease while it is connected, follows the log through the
process's ``LogTailer`` and renders each event with a pure renderer: chat and text
completion chunks (``ChunkRenderer``) or Responses events (``ResponsesRenderer``).
Every stream runs the same loop (``_stream``): a ``: ping`` while nothing comes (a long
prefill), "reconnect" when the process drains, an error in band when Redis lost the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import msgspec
from litestar import Request

from service.api.admission import RateLimited
from service.api.context import Context
from service.api.metrics import READERS, RETURNS
from service.api.response_input import kept
from service.api.seats import Seat, SeatsFull
from service.store.keys import principal as who
from service.store.mailbox import IDLE, Batch, Interrupted, LogLost, Subscription
from service.store.pool import STORE_ERRORS
from service.store.readers import Lease
from service.stream import endings, sse
from service.stream.events import Created, End, Error, Event, Progress
from service.stream.ids import Cursor, EventId
from service.stream.lifecycle import State
from service.stream.render import (
    ChunkRenderer,
    ResponseAggregate,
    coalesce,
    error_object,
    sse_event_frames,
)
from service.stream.response_events import Frame, ResponsesRenderer

log = logging.getLogger(__name__)


def _before(cursor: Cursor | None) -> EventId | None:
    """Where the tail must start so that a partly delivered event is read again."""
    if cursor is None:
        return None
    if cursor.frame is None:
        return cursor.event
    e = cursor.event
    return EventId(e.ms, e.seq - 1) if e.seq > 0 else EventId(e.ms - 1, 2**64 - 1)


class _Chunks:
    """Chat / text completion chunks from ``cursor`` on; a reader that fell behind gets
    runs of deltas merged."""

    coalesces = True

    def __init__(
        self, rid: str, created: Created, cursor: Cursor | None, framing: sse.Framing
    ) -> None:
        self.request_id = rid
        self._renderer = ChunkRenderer(rid, created)
        self._cursor = cursor
        self.framing = framing

    def frames(self, batch: Batch) -> tuple[bytes, bool]:
        out: list[bytes] = []
        for eid, event in batch:
            out.extend(sse_event_frames(self._renderer, eid, event, self._cursor, self.framing))
            if isinstance(event, End):
                return b"".join(out), True
        return b"".join(out), False

    def lost(self) -> bytes:  # an error in band (no end: the log is gone)
        return sse.frame(msgspec.json.encode(error_object(LOG_LOST)))


class _ResponseEvents:
    """Responses events after sequence number ``after``. The renderer counts events from
    the log's start, so the log is read from its first entry and never coalesced
    (merged deltas would renumber what follows)."""

    coalesces = False

    def __init__(self, rid: str, created: Created, after: int | None, framing: sse.Framing) -> None:
        self.request_id = rid
        self._renderer = response_renderer(rid, created)
        self._after = after
        self.framing = framing

    def frames(self, batch: Batch) -> tuple[bytes, bool]:
        out: list[Frame] = []
        for _eid, event in batch:
            fresh = self._renderer.feed(event)
            out += [f for f in fresh if self._after is None or f.sequence_number > self._after]
            if isinstance(event, End):
                return response_sse(out, self.framing), True
        return response_sse(out, self.framing), False

    def lost(self) -> bytes:  # the response fails in band
        return self.frames([(EventId(0, 0), e) for e in endings.lost_in_band()])[0]


async def _stream(
    ctx: Context, sub: Subscription, lease: Lease, render: _Chunks | _ResponseEvents
) -> AsyncIterator[bytes]:
    """Every stream's loop: ``render``'s frames of what the tail brings, until the end;
    a ``: ping`` when nothing came for ``keepalive_s``; "reconnect" when the process
    drains; the lease held meanwhile, with what it delivered."""
    lease.adopted = True
    READERS.inc()
    hint = ctx.settings.reconnect_hint_ms
    rid = render.request_id
    progress = Progress()
    try:
        framing = render.framing
        if opening := framing.opening(hint):
            yield opening  # how soon to come back
        while True:
            batch = await sub.queue.get()  # no timer per wait: the tailer's ticker sends IDLE
            if batch is IDLE:
                yield framing.keepalive()
                continue
            if isinstance(batch, Interrupted):  # shutting down: reconnect elsewhere
                if last := framing.reconnect(hint):
                    yield last
                return
            if isinstance(batch, LogLost):  # an error in band, never pings for ever
                yield render.lost()
                return
            if isinstance(batch, BaseException):
                raise batch
            if render.coalesces and sub.queue.qsize() >= ctx.settings.coalesce_backlog:
                batch = _catch_up(sub, batch)
            sound = _sound(progress, batch)
            out, ended = render.frames(batch[:sound])
            if out:
                yield out
            if sound < len(batch):  # a gap or a repeat: never sent, the stream ends
                log.warning("request %s: its log does not follow on; ending the stream", rid)
                yield render.lost()
                return
            # the send completed: what it carried reached the connection
            lease.delivered = max(lease.delivered, progress.tokens)
            if ended:
                lease.ended = True
                return
    finally:
        sub.close()
        READERS.dec()
        await lease.release()


async def sse_frames(
    ctx: Context,
    rid: str,
    created: Created,
    cursor: Cursor | None = None,
    *,
    lease: Lease | None = None,
    framing: sse.Framing = sse.RESUMABLE,
) -> AsyncIterator[bytes]:
    """The request's log as SSE chunks, from ``cursor`` on, until its terminal event
    (``lease``: the reader's, taken with its POST)."""
    render = _Chunks(rid, created, cursor, framing)
    async for out in _follow(ctx, created, _before(cursor), render, lease=lease):
        yield out


async def response_frames(
    ctx: Context,
    rid: str,
    created: Created,
    after: int | None = None,
    *,
    lease: Lease | None = None,
    logged: Batch | None = None,
    framing: sse.Framing = sse.RESUMABLE,
) -> AsyncIterator[bytes]:
    """The response's events after sequence number ``after``, until its end. Its log is
    read from the first entry (the renderer counts from there); ``logged``: the log as the
    caller just read it, so that the tail goes on from there instead of reading it again."""
    render = _ResponseEvents(rid, created, after, framing)
    async for out in _follow(ctx, created, None, render, lease=lease, logged=logged):
        yield out


def _sound(progress: Progress, batch: Batch) -> int:
    """How many of ``batch``'s events follow on from what was sent (all, but at a gap or
    a repeat)."""
    for i, (_eid, event) in enumerate(batch):
        if not progress.follows(event):
            return i
    return len(batch)


def seated(
    ctx: Context, rid: str, created: Created, frames: AsyncIterator[bytes]
) -> AsyncIterator[bytes]:
    """``frames`` holding one of the process's reader seats of the request and its key
    (``seats.py``); 429 now, before the stream starts, when either is full."""
    try:
        seat = ctx.seats.take(rid, who(created.tenant, created.api_key_id))
    except SeatsFull as exc:
        raise RateLimited(f"{exc}; retry", retry_after_s=1, code="too_many_readers") from None
    held = _held(frames, seat)
    weakref.finalize(held, seat.release)  # a stream never started gives it back too
    return held


async def _held(frames: AsyncIterator[bytes], seat: Seat) -> AsyncIterator[bytes]:
    try:
        async for out in frames:
            yield out
    finally:
        seat.release()


async def admit_return(ctx: Context, rid: str, created: Created) -> None:
    """A reader about to come back to a parked request (which its lease makes go on) is
    admitted as a new request is, against its key's limit in flight: 429 otherwise, the
    request staying parked. (Only with that limit set: one more read per reconnect.)"""
    if ctx.settings.max_concurrent_per_key and await ctx.log.state(rid) == State.PARKED:
        await ctx.admission.returning(who(created.tenant, created.api_key_id), rid)


async def reader_lease(ctx: Context, rid: str, created: Created) -> Lease:
    """A (re)connecting reader's lease. One that comes back to a parked request makes it go
    on (``lease_and_unpark.lua`` queues it again); it is in flight again for its key's limit (taken
    by ``admit_return`` before the stream began; held here for one that raced it)."""
    lease = await ctx.presence.acquire(rid)
    if lease.unparked:
        RETURNS.inc()
        with contextlib.suppress(*STORE_ERRORS):  # (a slot the end frees again anyway)
            await ctx.admission.resumed(who(created.tenant, created.api_key_id), rid)
    return lease


async def _follow(
    ctx: Context,
    created: Created,
    start: EventId | None,
    render: _Chunks | _ResponseEvents,
    *,
    lease: Lease | None = None,
    logged: Batch | None = None,
    framing: sse.Framing = sse.RESUMABLE,
) -> AsyncIterator[bytes]:
    """Follow the log after ``start``, holding a presence lease while connected."""
    rid = render.request_id
    # subscribe first: the tailer starts reading while the lease is written
    sub = ctx.tailer.subscribe(rid, start, keepalive=True, interruptible=True)
    if logged:
        sub.offer(logged)
    if lease is None:  # a (re)connecting reader: unless the caller read it, read what the
        # log holds while the lease is written, rather than wait for the tailer's wake and
        # next read (the resume latency a client feels)
        reading = None if logged else asyncio.ensure_future(ctx.log.read(rid, start))
        try:
            lease = await reader_lease(ctx, rid, created)
            if reading is not None:
                sub.offer(await reading)
        except BaseException:
            if reading is not None:
                reading.cancel()
            sub.close()
            if lease is not None:
                await lease.release()
            raise
    async for out in _stream(ctx, sub, lease, render):
        yield out


def _catch_up(sub: Subscription, batch: Batch) -> Batch:
    """A reader that fell behind (its client reads slowly): everything waiting, with runs
    of deltas merged into one event each."""
    while not sub.queue.empty():
        more = sub.queue.get_nowait()
        if more is IDLE:
            continue
        if isinstance(more, BaseException):  # send what we have first
            sub.queue.unget(more)
            break
        batch = batch + more
    return coalesce(batch)


LOG_LOST = Error(endings.LOG_LOST.code, endings.LOG_LOST.message)


async def _until_lost(sub: Subscription) -> AsyncIterator[Batch]:
    """The subscription's batches; a lost log ends it with an error and an ``errored`` end."""
    try:
        async for batch in sub.batches():
            yield batch
    except LogLost:
        yield [(EventId(0, 0), e) for e in endings.lost_in_band()]


async def collect(ctx: Context, rid: str, created: Created, lease: Lease) -> ResponseAggregate:
    """Wait for the whole answer (a non-streaming client, holding ``lease`` meanwhile)."""
    agg = ResponseAggregate(rid, created)
    await _until_end(ctx, rid, lease, agg.add)
    return agg


async def _until_end(ctx: Context, rid: str, lease: Lease, feed: Callable[[Event], object]) -> None:
    """Feed every event of the log to ``feed`` until its end, holding ``lease``."""
    lease.adopted = True
    sub = ctx.tailer.subscribe(rid, None)
    READERS.inc()
    progress = Progress()
    try:
        async for batch in _until_lost(sub):
            for _eid, event in batch:
                if not progress.follows(event):  # a gap or a repeat: the answer is lost
                    log.warning("request %s: its log does not follow on", rid)
                    for lost in endings.lost_in_band():
                        feed(lost)
                    return
                feed(event)
                if isinstance(event, End):
                    lease.delivered = event.completion_tokens
                    lease.ended = True
                    return
    finally:
        sub.close()
        READERS.dec()
        await lease.release()


def response_renderer(rid: str, created: Created) -> ResponsesRenderer:
    """The Responses renderer of a request made by POST /v1/responses."""
    params, _ = kept(created.response)
    return ResponsesRenderer(rid, created, params)


def response_sse(frames: list[Frame], framing: sse.Framing = sse.RESUMABLE) -> bytes:
    """Responses events as SSE: ``event:`` its type, ``id:`` its sequence number (so a
    ``Last-Event-ID`` reconnect is a ``starting_after``) where the framing has ids."""
    return b"".join(framing.event(f.json(), f.sequence_number, f.type) for f in frames)


async def response_collect(
    ctx: Context, rid: str, created: Created, lease: Lease
) -> ResponsesRenderer:
    """Wait for the whole response (a non-streaming client, holding ``lease``)."""
    renderer = response_renderer(rid, created)
    await _until_end(ctx, rid, lease, renderer.feed)
    return renderer


T = TypeVar("T")


async def until_disconnect(
    request: Request[Any, Any, Any], work: Coroutine[Any, Any, T]
) -> T | None:
    """Run ``work`` unless the client disconnects first (then cancel it, return None)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    return task.result() if not task.cancelled() else None
