"""Multiplexed log tailing: one task and one Redis connection per shard of up to 1,000
followed logs of one partition.

Every connected reader (an SSE client, a waiting non-streaming client) subscribes
to one request's log from a position. Each shard blocks on its own *wake* stream;
appends to the logs it follows name the log there (the shard registered itself in
each log's ``tails`` set), a new subscription wakes it too; then one ``XREAD`` reads
the logs named and the entries go out to the subscribers' queues. Redis connections
stay O(streams / shard size) per process, not O(clients), and a read costs O(logs that
changed). See ``_Shard`` for how a lost notification is made up for.

Redis Cluster: a multi-key ``XREAD`` needs all its keys in one slot. A shard follows the
logs of one partition (one slot: ``keys.py``) and its wake stream is in it too, so an API
process has at least one shard per partition it has readers in, each a read on the node
that serves the partition.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis

from service.store import scripts
from service.store.keys import EVENT_FIELD, LOG_FIELD, Keys
from service.store.pool import STORE_ERRORS, is_cluster
from service.stream import events as ev
from service.stream.ids import EventId

log = logging.getLogger(__name__)

Batch = list[tuple[EventId, ev.Event]]
_START = EventId(0, 0)


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


class Subscription:
    """One reader's view of one log: an async iterator of event batches."""

    def __init__(
        self,
        tailer: LogTailer,
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
            self.queue.put_nowait(fresh)


class LogTailer:
    """All of an API process's readers, over shards of at most ``shard_size`` logs.

    Each shard is one ``XREAD BLOCK`` naming every log it follows, so a read costs
    O(logs in the shard); a new reader wakes only its shard. With one shard, opening
    the 10,000th idle stream re-issued a 10,000-key read (quadratic in all).
    """

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        *,
        block_ms: int = 5000,
        count: int = 512,
        shard_size: int = 1000,
        keepalive_s: float | None = None,
        writer: Redis | None = None,
    ) -> None:
        """``redis`` holds one connection per shard in ``XREAD BLOCK`` (so its pool caps the
        shards: 64 connections, ~63,000 followed logs); ``writer`` (default ``redis``) sends
        the wakes, so that they never queue behind blocked reads."""
        self._redis = writer or redis
        # the same pool, but XREAD replies left as Redis sent them: redis-py's reply
        # parsing (a dict per entry) cost more than the read itself with 500 streams
        if is_cluster(redis):  # (a cluster client has a pool per node: this client's own)
            self._reader = redis
        else:
            self._reader = Redis(connection_pool=redis.connection_pool)
        self._reader.set_response_callback("XREAD", _raw_reply)
        self._keys = keys
        self._block_ms = block_ms
        self._count = count
        self._shard_size = shard_size
        self._shards: list[_Shard] = []
        self._shard_of: dict[str, _Shard] = {}  # log key -> the shard following it
        self._interrupted: Interrupted | None = None
        self._keepalive_s = keepalive_s
        self._ticker: asyncio.Task[None] | None = None

    @property
    def reads(self) -> int:
        """XREAD calls made (tests, metrics)."""
        return sum(s.reads for s in self._shards)

    @property
    def subscriptions(self) -> int:
        return sum(len(subs) for s in self._shards for subs in s.subs.values())

    @property
    def shards(self) -> int:
        return len(self._shards)

    async def start(self) -> None:
        """Shards start with their first reader; the keepalive ticker starts now."""
        if self._keepalive_s:
            self._ticker = asyncio.create_task(self._tick(self._keepalive_s), name="keepalive")

    async def stop(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()
            await asyncio.gather(self._ticker, return_exceptions=True)
        await asyncio.gather(*(s.stop() for s in self._shards))

    async def _tick(self, every_s: float) -> None:
        """``IDLE`` to each keepalive reader that got nothing for ``every_s``
        (checked every quarter of it: a keepalive is late by at most that). The logs of
        such idle readers are checked to still exist: one that Redis lost (it restarted
        without its data) gets ``LogLost`` to all of its readers, instead of pings for ever."""
        while True:
            await asyncio.sleep(every_s / 4)
            due = time.monotonic() - every_s
            idle: dict[str, set[Subscription]] = {}
            for shard in self._shards:
                for key, subs in shard.subs.items():
                    if any(sub.queue.last_put <= due for sub in subs):
                        idle[key] = subs
                    for sub in subs:
                        if sub.keepalive and sub.queue.last_put <= due:
                            sub.queue.put_nowait(IDLE)
            if idle:
                await self._check_exist(idle)

    async def _check_exist(self, idle: dict[str, set[Subscription]]) -> None:
        keys = list(idle)
        try:
            pipe = self._redis.pipeline(transaction=False)
            for key in keys:
                pipe.exists(key)
            found = await pipe.execute()
        except STORE_ERRORS as exc:  # Redis away: the next tick asks again
            log.warning("cannot check followed logs: %s", exc)
            return
        for key, exists in zip(keys, found, strict=True):
            if not exists:
                lost = LogLost(f"the log {key} is gone: Redis lost it")
                for sub in list(idle[key]):
                    sub.queue.put_nowait(lost)

    def subscribe(
        self,
        request_id: str,
        after: EventId | None = None,
        *,
        keepalive: bool = False,
        interruptible: bool = False,
    ) -> Subscription:
        """Follow ``request_id``'s log after ``after``. A ``keepalive`` subscription gets
        ``IDLE`` in its queue when nothing came for ``keepalive_s``; an ``interruptible``
        one gets ``Interrupted`` when ``interrupt`` is called (the process drains). A
        stream has both; a reader collecting one JSON answer neither."""
        sub = Subscription(
            self, request_id, after, keepalive=keepalive, interruptible=interruptible
        )
        if interruptible and self._interrupted is not None:
            sub.queue.put_nowait(self._interrupted)
        key = self._keys.log(request_id)
        shard = self._shard_of.get(key)
        if shard is None:
            part = self._keys.partition(request_id)
            shard = next(
                (s for s in self._shards if s.partition == part and len(s.subs) < self._shard_size),
                None,
            )
            if shard is None:
                shard = _Shard(
                    self._redis,
                    self._reader,
                    self._keys,
                    part,
                    self._block_ms,
                    self._count,
                )
                self._shards.append(shard)
            self._shard_of[key] = shard
        shard.add(key, sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        key = self._keys.log(sub.request_id)
        shard = self._shard_of.get(key)
        if shard is not None and not shard.remove(key, sub):
            del self._shard_of[key]

    def interrupt(self) -> None:
        """Wake every interruptible reader with ``Interrupted`` (now and from now on)."""
        self._interrupted = Interrupted("draining")
        for shard in self._shards:
            for subs in shard.subs.values():
                for sub in subs:
                    if sub.interruptible:
                        sub.queue.put_nowait(self._interrupted)


SWEEP_S = 1.0  # a shard reads all of its logs this often (what a lost notification costs)
WAKE_COUNT = 10_000  # wake entries taken in one read


class _Shard:
    """The followers of a set of logs of one partition, over one Redis connection.

    Appends notify: a shard registers its wake stream in each followed log's ``tails``
    set, and every append to the log adds the log's key to the wake streams there. The
    shard blocks reading its wake stream alone, then reads only the logs named, from its
    slowest reader's position: a read costs O(logs that changed), not O(logs followed).
    (With the old one ``XREAD BLOCK`` over every followed log, Redis's cost per read grew
    with the shard: 109 us per read of 50 logs, the largest command cost per token.)

    A notification can be lost -- a registration Redis lost (a restart, a failover), a
    wake stream that outran its cap while the shard did not read -- so the shard also
    reads all its logs every ``SWEEP_S``, and registers them all again after a store
    error. A new follower registers first and then reads the log once: what came before
    the registration is not missed, what comes after is notified."""

    def __init__(
        self,
        redis: Redis,
        reader: Redis,
        keys: Keys,
        partition: int,
        block_ms: int,
        count: int,
    ) -> None:
        self._redis = redis
        self._reader = reader
        self._keys = keys
        self._block_ms = block_ms
        self._count = count
        self.partition = partition
        self._wake_key = keys.wake(partition, uuid.uuid4().hex)
        self._wake_last = b"0-0"
        self._wake_pending = False  # a send (registrations, a wake) is to go out
        self.subs: dict[str, set[Subscription]] = {}
        self._positions: dict[str, bytes] = {}  # log key -> id to read after (its slowest reader)
        self._rids: dict[str, str] = {}  # log key -> its request id (the logs registered)
        self._dirty: set[str] = set()  # logs to read: notified, or followed further back
        self._register: set[str] = set()  # logs to register this shard's wake stream in
        self._unregister: dict[str, str] = {}  # log key -> tails set to leave
        self._reregister = False  # after a store error: every followed log again
        self._ended: set[str] = set()  # logs read to their end (their tails set is gone)
        self._swept = time.monotonic()
        self._follow = scripts.register(redis, "follow")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="log-tailer")
        self.reads = 0

    async def stop(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
        with contextlib.suppress(*STORE_ERRORS):
            pipe = self._redis.pipeline(transaction=False)
            for rid in self._rids.values():
                pipe.srem(self._keys.tails(rid), self._wake_key)
            pipe.delete(self._wake_key)
            await pipe.execute()

    def add(self, key: str, sub: Subscription) -> None:
        subs = self.subs.setdefault(key, set())
        subs.add(sub)
        self._reposition(key)
        if key in self._rids:  # followed already: read it again from the new position
            self._dirty.add(key)
        else:
            self._rids[key] = sub.request_id
            self._unregister.pop(key, None)
            self._register.add(key)
        self._send_soon()

    def remove(self, key: str, sub: Subscription) -> bool:
        """Drop ``sub``; False when nobody here follows ``key`` any more."""
        subs = self.subs.get(key)
        if subs is not None:
            subs.discard(sub)
            if not subs:
                del self.subs[key]
        self._reposition(key)
        if key in self.subs:
            return True
        rid = self._rids.pop(key, None)
        self._register.discard(key)
        self._dirty.discard(key)
        if key in self._ended:  # the end's script dropped the tails set: nothing to leave
            self._ended.discard(key)
        elif rid is not None:
            self._unregister[key] = self._keys.tails(rid)
            self._send_soon()
        return False

    def _reposition(self, key: str) -> None:
        subs = self.subs.get(key)
        if subs:
            self._positions[key] = str(min(s.position for s in subs)).encode()
        else:
            self._positions.pop(key, None)

    def _send_soon(self) -> None:
        if self._wake_pending:
            return
        self._wake_pending = True
        asyncio.get_running_loop().create_task(self._send())

    async def _send(self) -> None:
        """Registrations, departures and a wake: one script call (``follow.lua``)."""
        # cleared before the call goes out: whatever comes from here on sends again
        self._wake_pending = False
        register, self._register = self._register, set()
        leave, self._unregister = self._unregister, {}
        keys = [self._wake_key]
        for key in register:
            rid = self._rids[key]
            keys += [self._keys.meta(rid), self._keys.tails(rid), key]
        keys += leave.values()
        try:
            await self._follow(keys=keys, args=[len(register)])
        except STORE_ERRORS as exc:  # the loop's own error handling registers all again
            log.warning("tail registration failed: %s", exc)
            self._reregister = True

    async def _run(self) -> None:
        backoff = 0.05
        while True:
            try:
                if self._reregister:
                    self._reregister = False
                    self._register |= set(self._rids)
                    self._dirty |= set(self._positions)
                    await self._send()
                if time.monotonic() - self._swept >= SWEEP_S:
                    self._swept = time.monotonic()
                    self._dirty |= set(self._positions)
                if self._dirty:
                    await self._read_changed()
                    continue
                sweep_in = SWEEP_S - (time.monotonic() - self._swept)
                block = max(1, min(self._block_ms, int(sweep_in * 1000) + 1))
                reply: Any = await self._reader.xread(
                    {self._wake_key: self._wake_last}, count=WAKE_COUNT, block=block
                )
                self.reads += 1
                backoff = 0.05
            except STORE_ERRORS as exc:
                log.warning("log tail read failed (retrying in %.2fs): %s", backoff, exc)
                self._reregister = True
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            for _key, entries in _streams_of(reply):
                self._woken(entries)

    def _woken(self, entries: list[list[Any]]) -> None:
        """The wake stream's entries: the logs named are to be read."""
        if not entries:
            return
        self._wake_last = entries[-1][0]
        for _eid, fields in entries:
            key = _value(fields, LOG_FIELD)
            if key is not None:
                name = key.decode()
                if name in self._positions:
                    self._dirty.add(name)

    async def _read_changed(self) -> None:
        keys = [key for key in self._dirty if key in self._positions]
        self._dirty = set()
        if not keys:
            return
        streams = {key: self._positions[key] for key in keys}
        names: dict[Any, Any] = streams
        try:
            reply: Any = await self._reader.xread(names, count=self._count)
        except BaseException:
            self._dirty |= set(keys)  # read them when the store answers again
            raise
        self.reads += 1
        for raw_key, entries in _streams_of(reply):
            key = raw_key.decode() if isinstance(raw_key, bytes) else raw_key
            if len(entries) >= self._count:
                self._dirty.add(key)  # more than one read's worth: the rest next
            try:
                self._dispatch(key, entries, streams[key])
            except Exception:  # one bad entry must not stop the shard's other readers
                log.exception("cannot dispatch entries of %s", key)

    def _dispatch(self, key: str, entries: list[list[Any]], read_from: bytes) -> None:
        """``entries``: ``[[id, [field, value, ...]], ...]`` as Redis sent them."""
        subs = self.subs.get(key)
        if not subs:
            return
        start = EventId.from_redis(read_from)
        batch = [(EventId.from_redis(eid), ev.decode(_field(fields))) for eid, fields in entries]
        if batch and isinstance(batch[-1][1], ev.End):
            self._ended.add(key)
        for sub in list(subs):
            # A reader that subscribed (further back) while this read was in flight would
            # see a gap; it gets these entries from the next read, which starts at its position.
            if sub.position >= start:
                sub.offer(batch)
        self._reposition(key)


def _streams_of(reply: Any) -> list[tuple[Any, list[list[Any]]]]:
    """An XREAD reply as (stream name, entries) pairs (RESP2 list or RESP3 map)."""
    if isinstance(reply, dict):
        return list(reply.items())
    return list(reply or ())


def _value(fields: list[bytes] | dict[bytes, bytes], name: bytes) -> bytes | None:
    if isinstance(fields, dict):
        return fields.get(name)
    for i in range(0, len(fields) - 1, 2):
        if fields[i] == name:
            return fields[i + 1]
    return None


def _raw_reply(response: Any, **_options: Any) -> Any:
    return response


def _field(fields: list[bytes] | dict[bytes, bytes]) -> bytes:
    """The event payload of an entry's field list (RESP2) or map (RESP3)."""
    value = _value(fields, EVENT_FIELD)
    if value is None:
        raise KeyError(EVENT_FIELD)
    return value
