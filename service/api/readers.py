"""Readers: a request's log read back as SSE bytes, or collected into one JSON answer.

A reader holds a presence lease while it is connected, follows the log through the
process's ``LogTailer`` and renders each event with the pure ``ChunkRenderer``.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable

import msgspec

from service.api.context import Context
from service.api.metrics import READERS
from service.api.responses import kept
from service.store.presence import Lease
from service.store.tail import IDLE, Batch, Interrupted, LogLost, Subscription
from service.stream import sse
from service.stream.events import Created, Delta, End, Error, Event
from service.stream.ids import Cursor, EventId
from service.stream.lifecycle import State
from service.stream.render import (
    ChunkRenderer,
    ResponseAggregate,
    coalesce,
    error_object,
    sse_event_frames,
)
from service.stream.responses import Frame, ResponsesRenderer


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
    sent: dict[int, int] = {}  # per choice: the completion tokens its deltas reached
    try:
        yield sse.retry_line(ctx.settings.reconnect_hint_ms)  # how soon to come back
        while True:
            batch = await sub.queue.get()  # no timer per wait: the tailer's ticker sends IDLE
            if batch is IDLE:
                yield sse.KEEPALIVE
                continue
            if isinstance(batch, Interrupted):  # shutting down: reconnect elsewhere
                yield sse.retry(ctx.settings.reconnect_hint_ms)
                return
            if isinstance(batch, LogLost):  # an error in band, never pings for ever
                yield sse.frame(msgspec.json.encode(error_object(LOG_LOST)))
                return
            if isinstance(batch, BaseException):
                raise batch
            if sub.queue.qsize() >= ctx.settings.coalesce_backlog:
                batch = _catch_up(sub, batch)
            out, reached, ended = _frames(renderer, batch, cursor, sent)
            if out:
                yield out
            sent = reached  # the send completed: it reached the connection
            lease.delivered = max(lease.delivered, sum(sent.values()))
            if ended:
                lease.ended = True
                return
    finally:
        sub.close()
        READERS.dec()
        await lease.release()


def nothing_after(
    rid: str, created: Created, last: tuple[EventId, Event] | None, cursor: Cursor | None
) -> bool:
    """The cursor is on the terminal event, past its last frame: the client has it all
    (the caller answers 204, the SSE standard's "stop reconnecting")."""
    if cursor is None or last is None or not isinstance(last[1], End):
        return False
    if cursor.event != last[0]:
        return False
    return not sse_event_frames(ChunkRenderer(rid, created), last[0], last[1], cursor)


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


def _frames(
    renderer: ChunkRenderer, batch: Batch, cursor: Cursor | None, sent: dict[int, int]
) -> tuple[bytes, dict[int, int], bool]:
    """The batch's SSE bytes, the completion tokens (per choice) they bring the reader
    to, and whether the terminal event is among them (nothing after it is sent)."""
    out: list[bytes] = []
    reached = dict(sent)
    for eid, event in batch:
        if isinstance(event, Delta):
            reached[event.index] = max(reached.get(event.index, 0), event.n)
        out.extend(sse_event_frames(renderer, eid, event, cursor))
        if isinstance(event, End):
            return b"".join(out), reached, True
    return b"".join(out), reached, False


LOG_LOST = Error(
    code="log_lost",
    message="the request's log was lost (Redis restarted without its data); send it again",
)


async def _until_lost(sub: Subscription) -> AsyncIterator[Batch]:
    """The subscription's batches; a lost log ends it with an error and an ``errored`` end."""
    try:
        async for batch in sub.batches():
            yield batch
    except LogLost:
        yield [(EventId(0, 0), LOG_LOST), (EventId(0, 0), End(str(State.ERRORED), None, 0, 0))]


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
    try:
        async for batch in _until_lost(sub):
            for _eid, event in batch:
                feed(event)
                if isinstance(event, End):
                    lease.delivered = event.completion_tokens
                    lease.ended = True
                    return
    finally:
        sub.close()
        READERS.dec()
        await lease.release()


async def cold_frames(
    rid: str, entries: list[tuple[EventId, Event]], cursor: Cursor | None, reconnect_hint_ms: int
) -> AsyncIterator[bytes]:
    """An archived log as SSE: the same ids and bytes the hot log gave."""
    created = entries[0][1]
    assert isinstance(created, Created)
    renderer = ChunkRenderer(rid, created)
    out: list[bytes] = [sse.retry_line(reconnect_hint_ms)]
    for eid, event in entries:
        out.extend(sse_event_frames(renderer, eid, event, cursor))
    if out:
        yield b"".join(out)


def response_renderer(rid: str, created: Created) -> ResponsesRenderer:
    """The Responses renderer of a request made by POST /v1/responses."""
    params, _ = kept(created.response)
    return ResponsesRenderer(rid, created, params)


def response_sse(frames: list[Frame]) -> bytes:
    """Responses events as SSE: ``event:`` its type, ``id:`` its sequence number (so a
    ``Last-Event-ID`` reconnect is a ``starting_after``)."""
    return b"".join(sse.frame(f.json(), str(f.sequence_number), f.type) for f in frames)


async def response_frames(
    ctx: Context,
    rid: str,
    created: Created,
    after: int | None = None,
    lease: Lease | None = None,
    logged: Batch | None = None,
) -> AsyncIterator[bytes]:
    """The request's Responses events after sequence number ``after``, until its end;
    ``logged``: its log as the caller just read it (from the first entry), so that the
    tail goes on from there instead of reading it again.

    The renderer counts the events from the log's start, so the log is always read from
    its first entry, and never coalesced (merged deltas would renumber what follows)."""
    renderer = response_renderer(rid, created)
    sub = ctx.tailer.subscribe(rid, None)
    if logged:
        sub.offer(logged)
    if lease is None:
        try:
            lease = await ctx.presence.acquire(rid)
        except BaseException:
            sub.close()
            raise
    lease.adopted = True
    READERS.inc()
    try:
        yield sse.retry_line(ctx.settings.reconnect_hint_ms)
        async for batch in _until_lost(sub):
            out: list[Frame] = []
            ended = False
            for _eid, event in batch:
                out += [
                    f for f in renderer.feed(event) if after is None or f.sequence_number > after
                ]
                if isinstance(event, End):
                    ended = True
                    break
            if out:
                yield response_sse(out)
            if ended:
                lease.ended = True
                return
    finally:
        sub.close()
        READERS.dec()
        await lease.release()


async def response_collect(
    ctx: Context, rid: str, created: Created, lease: Lease
) -> ResponsesRenderer:
    """Wait for the whole response (a non-streaming client, holding ``lease``)."""
    renderer = response_renderer(rid, created)
    await _until_end(ctx, rid, lease, renderer.feed)
    return renderer
