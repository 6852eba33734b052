"""Reading request logs from Redis: entries, the meta hash, the first and last entry,
one round trip for a reconnect. ``RedisLog`` (``log.py``) adds the writes."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import EVENT_FIELD, Keys
from service.stream import events as ev
from service.stream.endings import Recovery
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


class LogReader:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def meta(self, request_id: str) -> RequestMeta | None:
        raw = await self.redis.hgetall(self.keys.meta(request_id))
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

    async def read(
        self, request_id: str, after: EventId | None = None, count: int | None = None
    ) -> list[tuple[EventId, ev.Event]]:
        start = "-" if after is None else f"({after}"
        raw: Any = await self.redis.xrange(self.keys.log(request_id), min=start, count=count)
        return _entries(raw)

    async def read_raw(self, request_id: str) -> list[tuple[EventId, bytes]]:
        """Every entry's id and payload bytes, as stored (what the archive keeps)."""
        raw: Any = await self.redis.xrange(self.keys.log(request_id))
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
        results: Any = await pipe.execute()
        first, last = _entries(results[0]), _entries(results[-1])
        found = bool(results[1]) if event_id is not None else False
        return (first[0] if first else None), found, (last[0] if last else None)

    async def first(self, request_id: str) -> ev.Created | None:
        found = await self.first_with_id(request_id)
        return None if found is None else found[1]

    async def first_with_id(self, request_id: str) -> tuple[EventId, ev.Created] | None:
        entries = await self.read(request_id, count=1)
        if not entries or not isinstance(entries[0][1], ev.Created):
            return None
        return entries[0][0], entries[0][1]

    async def last(self, request_id: str) -> tuple[EventId, ev.Event] | None:
        raw: Any = await self.redis.xrevrange(self.keys.log(request_id), count=1)
        entries = _entries(raw)
        return entries[0] if entries else None
