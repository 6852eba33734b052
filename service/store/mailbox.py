"""What a tail shard hands a reader: batches of a log's entries, and the markers a reader
acts on (``IDLE``: send a keepalive; ``Interrupted``: tell the client to reconnect;
``LogLost``: say so in band) -- in a one-consumer mailbox per reader, the queue of its
``Subscription``. The shards (``shard.py``), the node's feed (``local.py``) and the
tailer (``tail.py``) all import this; it imports none of them (``Tailer`` is what a
subscription and the feed need of the tailer)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Protocol

from service.stream import events as ev
from service.stream.ids import EventId

Batch = list[tuple[EventId, ev.Event]]


class Interrupted(Exception):
    """Put in every interruptible subscription's queue when the process starts draining
    (its reader tells its client to reconnect, elsewhere)."""


class Idle(Exception):
    """Put in a keepalive subscription's queue when nothing came for ``keepalive_s`` (its
    reader sends a keepalive). One ticker for all readers: no timer per wait."""


IDLE = Idle()


class LogLost(Exception):
    """Put in a reader's queue when the log it follows no longer exists although the
    request never ended in it: Redis lost it (a restart without persistence)."""


class Mailbox:
    """An unbounded queue for one consumer: what ``asyncio.Queue`` does for a reader,
    without its four deques (~1.8 KiB per open stream, measured with tracemalloc)."""

    __slots__ = ("_items", "_waiter", "last_put")

    def __init__(self) -> None:
        self._items: list[Batch | BaseException] = []
        self._waiter: asyncio.Future[None] | None = None
        self.last_put = time.monotonic()

    def put_nowait(self, item: Batch | BaseException) -> None:
        self._items.append(item)
        self.last_put = time.monotonic()
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def unget(self, item: Batch | BaseException) -> None:
        """Put ``item`` back in front (a reader that took more than it could use)."""
        self._items.insert(0, item)

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def get_nowait(self) -> Batch | BaseException:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.pop(0)

    async def get(self) -> Batch | BaseException:
        while not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None
        return self._items.pop(0)


_START = EventId(0, 0)


class Tailer(Protocol):
    """What a subscription and the node's feed ask of the tailer (``tail.LogTailer``)."""

    def unsubscribe(self, sub: Subscription) -> None: ...

    def to_local(self, request_id: str) -> None: ...

    def to_redis(self, subs: set[Subscription]) -> None: ...


class Subscription:
    """One reader's view of one log: an async iterator of event batches."""

    def __init__(
        self,
        tailer: Tailer,
        request_id: str,
        after: EventId | None,
        *,
        keepalive: bool,
        interruptible: bool,
    ) -> None:
        self.tailer = tailer
        self.request_id = request_id
        self.position = after or _START
        self.keepalive = keepalive
        self.interruptible = interruptible
        self.queue = Mailbox()
        self.local = False  # fed by the node's worker (``local.py``), not a shard
        self.held: Batch | None = None  # fed while its read back is on its way
        self.ended = False  # its log's end was handed over
        self.attached = 0  # times put on the feed: a read back serves its own attachment

    async def batches(self) -> AsyncIterator[Batch]:
        while True:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        self.tailer.unsubscribe(self)

    def offer(self, entries: Batch) -> None:
        """Queue what is newer than this reader's position (the tailer's reads, or a
        reader's own catch-up read: whichever comes second is filtered)."""
        fresh = [(eid, e) for eid, e in entries if eid > self.position]
        if fresh:
            self.position = fresh[-1][0]
            self.ended = isinstance(fresh[-1][1], ev.End)
            self.queue.put_nowait(fresh)

    def offer_local(self, entries: Batch) -> None:
        """The node's worker's entries: held while the read back is on its way."""
        if self.held is not None:
            self.held.extend(entries)
        else:
            self.offer(entries)
