"""Request logs in Redis: create, claim, fenced append, the terminal write, cancel, read.

The atomic parts are Lua scripts shipped as package files (``service/store/scripts``).
A worker writes through its ``AppendBatcher`` (``batcher.py``): one script call per
flush for all of its requests. Every ending is written by ``end`` (an ``Ending`` from
``service/stream/endings.py``), whoever ends the request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from service.settings import Settings
from service.store import replies
from service.store.admission import Slot, free_slots
from service.store.commit import Committer, Durability
from service.store.keys import EVENT_FIELD, Keys
from service.store.scripts.append import Append, Appended, AppendScript
from service.store.scripts.cancel import Cancel, CancelOutcome
from service.store.scripts.claim import Claim
from service.store.scripts.codes import AppendReply, CancelReply, ClaimReply, ParkReply
from service.store.scripts.create import Create
from service.store.scripts.park import Park
from service.store.scripts.record_resume import RecordResume
from service.stream import endings
from service.stream import events as ev
from service.stream.endings import Ending, Failure, Recovery, Request
from service.stream.ids import EventId
from service.stream.lifecycle import Meta, State
from service.stream.resume import Looked


class LogError(Exception):
    """Base of the log's errors."""


class Fenced(LogError):
    """The caller no longer owns the request (another worker took it over)."""


class AlreadyEnded(LogError):
    """The request already has its terminal event."""


class LogGap(LogError):
    """The log does not hold what its owner wrote: Redis lost data (a restart without
    persistence, or the last second of an AOF ``everysec``)."""


class LogGone(LogGap):
    """Redis lost the whole request (a restart without persistence)."""


class RequestExists(LogError):
    """A log with this request id already exists."""


_APPEND_ERRORS: dict[AppendReply, type[LogError]] = {
    AppendReply.FENCED: Fenced,
    AppendReply.ENDED: AlreadyEnded,
    AppendReply.GONE: LogGone,
    AppendReply.GAP: LogGap,
    AppendReply.INVALID: LogError,
}


def _appended(reply: Appended) -> list[EventId] | LogError:
    if reply.code == AppendReply.OK:
        return reply.ids
    return _APPEND_ERRORS[reply.code](str(reply))


_decode_id = EventId.from_redis


def _entries(raw: Sequence[tuple[bytes, dict[bytes, bytes]]]) -> list[tuple[EventId, ev.Event]]:
    return [(_decode_id(entry_id), ev.decode(fields[EVENT_FIELD])) for entry_id, fields in raw]


def created_of(entries: Sequence[tuple[EventId, ev.Event]]) -> tuple[EventId, ev.Created] | None:
    """A log's ``created`` (its first entry), if the log still starts with it."""
    if entries and isinstance(entries[0][1], ev.Created):
        return entries[0][0], entries[0][1]
    return None


@dataclasses.dataclass(slots=True)
class RequestMeta:
    state: str
    epoch: int
    owner: str | None
    last_event_id: str | None
    recovery: Recovery = dataclasses.field(default_factory=lambda: Recovery())
    events: int = 0  # entries in the log
    delivered: int = 0  # the most completion tokens a reader's connection was sent


@dataclasses.dataclass(frozen=True, slots=True)
class Written:
    """What a request's log and meta hash hold now, as an ending made outside its run needs
    it (``endings.failed``, ``window_over``, ``cancelled_parked``): the request (its
    ``created``, prompt tokens, recovery counts), the completion tokens its deltas
    reached, and its meta hash (None: gone)."""

    request: Request
    completion_tokens: int
    meta: RequestMeta | None


@dataclasses.dataclass(frozen=True, slots=True)
class Retention:
    """How long a finished log stays in Redis (its meta and log keys' TTL from the end)."""

    hot_ttl_s: int = 3600
    unstored_ttl_s: int = 30  # ``store: false``: briefly (not archived either)
    # a request's keys outlive its last start (create, a continuation) this long at least:
    # its deadline (twice: a continuation's), then the finished log's hot TTL
    running_ttl_s: int = 3600 + 2 * 600
    # a request that goes on again (parked, a reader came back) waits this long for a
    # worker to take it, then ends errored (worker_lost: the sweeper)
    worker_wait_s: int = 600

    @classmethod
    def of(cls, settings: Settings) -> Retention:
        running = int(settings.hot_log_ttl_s + 2 * settings.request_deadline_s)
        wait = int(settings.takeover_wait_s or settings.request_deadline_s)
        return cls(settings.hot_log_ttl_s, settings.unstored_ttl_s, running, wait)

    def ttl_s(self, summary: ev.Summary) -> int:
        if not summary.store:
            return min(self.unstored_ttl_s, self.hot_ttl_s)
        return self.hot_ttl_s


class RedisLog:
    """Every request's log: its writes, and its reads (committed: ``commit.py``)."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        retention: Retention | None = None,
        committer: Committer | None = None,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.committer = committer or Committer(redis, keys, Durability.MEMORY)
        self.retention = retention or Retention()
        self._create = Create(redis, keys)
        self._claim = Claim(redis, keys)
        self._append = AppendScript(redis, keys)
        self._resumed = RecordResume(redis, keys)
        self._park = Park(redis, keys)
        self._cancel = Cancel(redis, keys)

    async def create(
        self,
        request_id: str,
        created: ev.Created,
        safety_ttl_s: int,
        *,
        grace_ms: int = 30_000,
        detached: bool = False,
        lease: tuple[str, int] | None = None,
        job: bytes = b"",
    ) -> EventId:
        """Write the log's first event; with ``lease`` (token, expiry ms) and ``job`` (an
        encoded queue entry) also the first reader's lease and the job, in the same step."""
        partition = self.keys.partition(request_id)
        mark = self.committer.mark(partition)
        done = await self._create(
            request_id,
            ev.encode(created),
            safety_ttl_s,
            grace_ms=grace_ms,
            detached=detached,
            lease=lease,
            job=job,
        )
        if done.event_id is None:
            raise RequestExists(f"{done.code} request already exists")
        # accepted only once committed: a creation a failover took back was answered 200,
        # then an in-band ``log_lost``, and the request left no end and no billing row
        # (the 30-minute cluster soak). Not confirmed: the store's error (a 503); the
        # request, if it survived, has no reader and ends as an abandoned one does.
        await self.committer.confirm(partition, mark)
        return done.event_id

    async def claim(
        self, request_id: str, worker_id: str, entry_id: bytes | str = ""
    ) -> Owner | None:
        """Become the owner (with the log's ``created`` event, read in the same step);
        ``None`` if the request is unknown or already ended, or if
        ``entry_id`` (the queue entry the caller holds) is not the request's current one.
        The same worker claiming again (a retry after a lost reply) keeps its epoch."""
        claimed = await self._claim(request_id, worker_id, replies.text(entry_id))
        if claimed.code != ClaimReply.OK:
            return None
        return Owner(request_id, claimed.epoch, claimed.events, claimed.first)

    async def resumed(self, owner: Owner, reprefill_tokens: int) -> Recovery:
        """The owner continues a request another worker started, prefilling
        ``reprefill_tokens`` again: the request's recovery counts so far, this one included.
        Raises ``Fenced`` if the caller is not the owner any more."""
        recovery = await self._resumed(owner.request_id, owner.epoch, reprefill_tokens)
        if recovery is None:
            raise Fenced(f"request {owner.request_id}: not owned by epoch {owner.epoch}")
        return recovery

    async def park(self, owner: Owner, entry_id: bytes, discarded: int) -> Parked:
        """Take the owner's request out of its hands, no reader being left (``park.lua``):
        parked until one comes back, or -- one came back meanwhile -- queued again at once.
        ``discarded``: tokens the owner made that are not in the log. Either way the owner
        is fenced out; ``Parked.window_ms`` is when its resume window is over."""
        rid = owner.request_id
        retention = self.retention
        parking = await self._park(
            rid,
            owner.epoch,
            entry_id,
            discarded,
            now_ms=int(time.time() * 1000),
            keep_ms=retention.running_ttl_s * 1000,
            wait_ms=retention.worker_wait_s * 1000,
        )
        if parking.code == ParkReply.PARKED:
            return Parked(window_ms=parking.window_ms)
        if parking.code == ParkReply.CONTINUED:
            return Parked(entry_id=parking.entry_id)
        raise Fenced(f"request {rid}: not parked by epoch {owner.epoch}")

    async def append(
        self,
        request_id: str,
        epoch: int,
        events: Sequence[ev.Event],
        *,
        terminal_state: str = "",
        ttl_s: int = 0,
        summary: bytes = b"",
        expect: int | None = None,
        inflight_key: str = "",
    ) -> list[EventId]:
        """The append script as it is: ``expect``: the entries the log must hold before
        these (``None``: no check); a terminal append (``terminal_state``) carries its
        TTL, outbox ``summary`` and ``inflight_key`` (the API key's in-flight set: its slot
        is freed with it). Ending a request is ``end``: it works those out from the ending
        (``closing``)."""
        item = Append(
            request_id, epoch, events, terminal_state, ttl_s, summary, expect, inflight_key
        )
        [result] = await self.append_many([item])
        if isinstance(result, LogError):
            raise result
        return result

    async def append_many(self, items: Sequence[Append]) -> list[list[EventId] | LogError]:
        """All of ``items``, one script call per queue (partition and lane) they are in (one
        round trip:
        the calls go out together), each gets its entry ids, or ``Fenced`` /
        ``AlreadyEnded`` / ``LogGap`` (that one is not written). Connection errors raise
        for all; the same items sent again are not written twice where they carry
        ``expect``. The admission slots of the requests that end are freed first."""
        by_queue: dict[str, list[int]] = {}
        for i, item in enumerate(items):
            by_queue.setdefault(self.keys.queue_of(item.request_id), []).append(i)
        # The ending requests' admission slots are freed before their ends are written: a
        # client that saw its answer end may send the next one at once. (Sent beside the
        # script calls, the ZREM -- another slot, on a cluster another node -- could still
        # be on its way when that next request was admitted: the cluster tier's per-key
        # concurrency test saw a 429 so.) Whatever the append then answers: an end that is
        # refused is already ended, or will be; only a fenced-out owner's end, or a worker
        # that dies right here, frees a slot early.
        ended = [
            Slot(item.inflight_key, item.request_id)
            for item in items
            if item.terminal_state and item.inflight_key
        ]
        if ended:
            await free_slots(self.redis, ended)
        replies_ = await asyncio.gather(
            *(self._append_queue(q, [items[i] for i in at]) for q, at in by_queue.items())
        )
        out: list[list[EventId] | LogError] = [LogError("unsent")] * len(items)
        for at, results in zip(by_queue.values(), replies_, strict=True):
            for i, result in zip(at, results, strict=True):
                out[i] = result
        return out

    async def _append_queue(
        self, queue: str, items: Sequence[Append]
    ) -> list[list[EventId] | LogError]:
        return [_appended(reply) for reply in await self._append(queue, items)]

    def terminal(
        self, request_id: str, epoch: int, ending: Ending, *, expect: int | None, ack: bytes
    ) -> Append:
        """The terminal append of ``ending`` (``endings.py``): its events, its state, its
        summary for the outbox, how long the finished log stays (``Retention``), the
        admission slot it frees and the queue entry ``ack`` it acknowledges -- all worked
        out here, from the ending, for every caller."""
        closing = self.closing(request_id, ending.summary)
        return Append(
            request_id,
            epoch,
            ending.events,
            terminal_state=ending.state,
            ttl_s=closing.ttl_s,
            summary=ev.encode_summary(ending.summary),
            expect=expect,
            inflight_key=closing.slot.inflight_key if closing.slot is not None else "",
            ack=ack,
        )

    def closing(self, request_id: str, summary: ev.Summary) -> Closing:
        """What an ending carries besides its events, worked out here only: how long the
        finished log stays (``Retention``) and the admission slot its write frees."""
        slot = Slot.of(self.keys, request_id, summary.tenant, summary.api_key_id)
        return Closing(self.retention.ttl_s(summary), slot)

    async def end(self, request_id: str, epoch: int, ending: Ending, *, ack: bytes = b"") -> None:
        """Write ``ending`` (the one terminal write; a worker's go through its batcher).
        Raises ``Fenced`` / ``AlreadyEnded`` / ``LogGap`` like ``append``."""
        [result] = await self.append_many(
            [self.terminal(request_id, epoch, ending, expect=None, ack=ack)]
        )
        if isinstance(result, LogError):
            raise result

    async def fail(
        self,
        request_id: str,
        epoch: int,
        failure: Failure,
        *,
        worker_id: str,
        prompt_tokens: int = 0,
        ack: bytes = b"",
    ) -> None:
        """End a request its worker can no longer finish (it vanished, or failed): errored,
        with the token counts its log reached (``prompt_tokens`` if its ``created`` is
        gone) and its recovery counts. Raises like ``end``."""
        w = await self.written(request_id, worker_id=worker_id, prompt_tokens=prompt_tokens)
        ending = endings.failed(w.request, failure, w.completion_tokens)
        await self.end(request_id, epoch, ending, ack=ack)

    async def cancel(
        self, rid: str, queued: Ending, parked: tuple[Ending, int] | None = None
    ) -> CancelOutcome:
        """``queued``: the request's ending if it is still queued; ``parked``: its ending
        if it is parked, and the entries of the log that ending was made from (``stale``
        when the log has others by now). ``cancel.lua`` writes the one that applies, with
        its outbox entry; its TTL and admission slot from it, as ``end``. A running
        request's owner is told on its channel (``owner.py``), and aborts it."""
        closing = self.closing(rid, queued.summary)
        outcome = await self._cancel(rid, queued, parked, closing.ttl_s)
        if outcome.outcome == State.CANCELLED and outcome.detail:
            await free_slots(self.redis, [closing.slot])  # ended here
        if outcome.outcome == CancelReply.CANCELLING and outcome.detail:
            await self.redis.publish(self.keys.control(outcome.detail), f"cancel:{rid}")
        return outcome

    async def delete(self, request_id: str) -> None:
        """Remove an ended request's log and control keys (one slot: its hash tag)."""
        k = self.keys
        await self.redis.delete(
            k.log(request_id),
            k.meta(request_id),
            k.readers(request_id),
            k.scratch(request_id),
            k.tails(request_id),
        )

    # -- reads: every read that answers a client returns only what is committed at the
    # ``committer``'s durability level (``commit.py``: confirmed after the read)

    async def _committed(self, request_id: str, mark: str) -> None:
        await self.committer.confirm(self.keys.partition(request_id), mark)

    def _mark(self, request_id: str) -> str:
        return self.committer.mark(self.keys.partition(request_id))

    async def written(
        self, request_id: str, *, worker_id: str | None = None, prompt_tokens: int = 0
    ) -> Written:
        """The request as its log and meta hash hold it now (``prompt_tokens``: if its
        ``created`` is gone)."""
        entries = await self.read(request_id)
        meta = await self.meta(request_id)
        first = created_of(entries)
        request = Request(
            request_id,
            first,
            first[1].prompt_tokens if first is not None else prompt_tokens,
            now_ms=int(time.time() * 1000),
            recovery=meta.recovery if meta is not None else Recovery(),
            worker_id=worker_id,
        )
        return Written(request, ev.completion_tokens(e for _, e in entries), meta)

    async def meta(self, request_id: str) -> RequestMeta | None:
        mark = self._mark(request_id)
        raw = await self.redis.hgetall(self.keys.meta(request_id))
        await self._committed(request_id, mark)
        if not raw:
            return None

        def number(name: Meta) -> int:
            return replies.integer(replies.field(raw, name) or 0)

        return RequestMeta(
            state=replies.text(replies.field(raw, Meta.STATE) or b""),
            epoch=number(Meta.EPOCH),
            owner=replies.text_or_none(replies.field(raw, Meta.OWNER)),
            last_event_id=replies.text_or_none(replies.field(raw, Meta.LAST)),
            recovery=Recovery(
                takeovers=number(Meta.TAKEOVERS),
                handovers=number(Meta.HANDOVERS),
                reprefill_tokens=number(Meta.REPREFILL),
                parks=number(Meta.PARKS),
                discarded_tokens=number(Meta.DISCARDED),
                paused_ms=number(Meta.PAUSED_MS),
                returned_ms=number(Meta.RETURNED_MS),
            ),
            events=number(Meta.EVENTS),
            delivered=number(Meta.DELIVERED),
        )

    async def state(self, request_id: str) -> str | None:
        """The request's state as Redis holds it now (None: gone), uncommitted: for a
        decision that the request's own scripts check again (admission)."""
        raw = await self.redis.hget(self.keys.meta(request_id), Meta.STATE)
        return None if raw is None else replies.text(raw)

    async def read(
        self, request_id: str, after: EventId | None = None, count: int | None = None
    ) -> list[tuple[EventId, ev.Event]]:
        start = "-" if after is None else f"({after}"
        mark = self._mark(request_id)
        raw: Any = await self.redis.xrange(self.keys.log(request_id), min=start, count=count)
        await self._committed(request_id, mark)
        return _entries(raw)

    async def read_raw(self, request_id: str) -> list[tuple[EventId, bytes]]:
        """Every entry's id and payload bytes, as stored (what the archive keeps)."""
        mark = self._mark(request_id)
        raw: Any = await self.redis.xrange(self.keys.log(request_id))
        await self._committed(request_id, mark)
        return [(_decode_id(entry_id), fields[EVENT_FIELD]) for entry_id, fields in raw]

    async def look(self, request_id: str, event_id: EventId | None) -> Looked:
        """One round trip for a reconnect: the log's first entry, whether ``event_id`` is
        an entry of this log, and its last two entries (a cursor on an in-band error sits
        just before an end that renders nothing)."""
        key = self.keys.log(request_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrange(key, count=1)
        if event_id is not None:
            pipe.xrange(key, min=str(event_id), max=str(event_id), count=1)
        pipe.xrevrange(key, count=2)
        mark = self._mark(request_id)
        results: Any = await pipe.execute()
        await self._committed(request_id, mark)
        first, tail = _entries(results[0]), _entries(results[-1])
        found = bool(results[1]) if event_id is not None else False
        return Looked(
            first[0][1] if first else None,
            tail[0] if tail else None,
            found,
            before_last=tail[1] if len(tail) > 1 else None,
        )

    async def first(self, request_id: str) -> ev.Created | None:
        found = await self.first_with_id(request_id)
        return None if found is None else found[1]

    async def first_with_id(self, request_id: str) -> tuple[EventId, ev.Created] | None:
        return created_of(await self.read(request_id, count=1))

    async def last(self, request_id: str) -> tuple[EventId, ev.Event] | None:
        mark = self._mark(request_id)
        raw: Any = await self.redis.xrevrange(self.keys.log(request_id), count=1)
        await self._committed(request_id, mark)
        entries = _entries(raw)
        return entries[0] if entries else None


@dataclasses.dataclass(frozen=True, slots=True)
class Closing:
    """An ending's TTL (its log's and meta's, from the end) and the admission slot its
    write frees (None: who sent the request is gone with its ``created``)."""

    ttl_s: int
    slot: Slot | None


@dataclasses.dataclass(frozen=True, slots=True)
class Parked:
    """A park's outcome: parked until ``window_ms``, or -- a reader came back meanwhile --
    queued again at once behind ``entry_id``."""

    window_ms: int | None = None
    entry_id: bytes | None = None


@dataclasses.dataclass(slots=True)
class Owner:
    """A claimed request: the epoch that fences its appends, and how many entries its log
    holds (where the owner's next append must start: a retried append is not doubled)."""

    request_id: str
    epoch: int
    events: int
    first: tuple[EventId, ev.Created] | None = None  # the log's ``created`` (from the claim)
