"""Reading request logs from Redis: entries, the meta hash, the first and last entry,
one round trip for a reconnect. ``RedisLog`` (``log.py``) adds the writes."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from service.store import replies
from service.store.commit import Committer, Durability
from service.store.keys import EVENT_FIELD, Keys
from service.stream import events as ev
from service.stream.endings import Recovery, Request
from service.stream.ids import EventId
from service.stream.lifecycle import Meta

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


class LogReader:
    """Every read that answers a client returns only what is committed at the
    ``committer``'s durability level (``commit.py``: confirmed after the read)."""

    def __init__(self, redis: Redis, keys: Keys, committer: Committer | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.committer = committer or Committer(redis, keys, Durability.MEMORY)

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

    async def look(
        self, request_id: str, event_id: EventId | None
    ) -> tuple[tuple[EventId, ev.Event] | None, bool, tuple[EventId, ev.Event] | None]:
        """One round trip for a reconnect: (first entry, whether ``event_id`` is an entry
        of this log, last entry)."""
        key = self.keys.log(request_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.xrange(key, count=1)
        if event_id is not None:
            pipe.xrange(key, min=str(event_id), max=str(event_id), count=1)
        pipe.xrevrange(key, count=1)
        mark = self._mark(request_id)
        results: Any = await pipe.execute()
        await self._committed(request_id, mark)
        first, last = _entries(results[0]), _entries(results[-1])
        found = bool(results[1]) if event_id is not None else False
        return (first[0] if first else None), found, (last[0] if last else None)

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
