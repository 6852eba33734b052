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
import logging
import time
from collections.abc import Iterator

from redis.asyncio import Redis

from service.store import replies
from service.store.commit import Committer, Durability
from service.store.keys import Keys
from service.store.local import LocalFeed
from service.store.mailbox import IDLE, Interrupted, LogLost, Subscription
from service.store.pool import STORE_ERRORS, is_cluster, survived
from service.store.shard import Shard, decoded
from service.stream.ids import EventId

log = logging.getLogger(__name__)

SWEEP_S = 1.0  # a shard reads all of its logs this often (what a lost notification costs)


def longest_block_s(block_ms: int) -> float:
    """The longest a shard's blocked read waits by itself (its socket timeout is this plus
    ``LASTEVENT_REDIS_SILENT_S``): it blocks until its next sweep at most."""
    return min(block_ms / 1000, SWEEP_S) + 0.01


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
        block_ms: int,
        count: int,
        shard_size: int,
        keepalive_s: float | None = None,
        writer: Redis | None = None,
        committer: Committer | None = None,
        feed: LocalFeed | None = None,
    ) -> None:
        """``redis`` holds one connection per shard in ``XREAD BLOCK`` (so its pool caps the
        shards: 64 connections, ~63,000 followed logs); ``writer`` (default ``redis``) sends
        the wakes, so that they never queue behind blocked reads. ``feed``: the node's
        worker's appends (``local.py``), for the readers of the requests it writes. The
        numbers are ``Settings``' ``tail_*`` (``api/app.py``); ``keepalive_s`` None: none."""
        self._redis = writer or redis
        self._committer = committer or Committer(self._redis, keys, Durability.MEMORY)
        # the same pool, but XREAD replies left as Redis sent them: redis-py's reply
        # parsing (a dict per entry) cost more than the read itself with 500 streams
        if is_cluster(redis):  # (a cluster client has a pool per node: this client's own)
            self._reader = redis
        else:
            self._reader = Redis(connection_pool=redis.connection_pool)
        self._reader.set_response_callback("XREAD", replies.raw)
        self._keys = keys
        self._block_ms = block_ms
        self._count = count
        self._shard_size = shard_size
        self._shards: list[Shard] = []
        self._shard_of: dict[str, Shard] = {}  # log key -> the shard following it
        self._interrupted: Interrupted | None = None
        self._keepalive_s = keepalive_s
        self._ticker: asyncio.Task[None] | None = None
        self._feed = feed
        self._reads_back: set[asyncio.Task[None]] = set()
        if feed is not None:
            feed.bind(self)

    @property
    def reads(self) -> int:
        """XREAD calls made (tests, metrics)."""
        return sum(s.reads for s in self._shards)

    @property
    def subscriptions(self) -> int:
        return sum(1 for _ in self._all())

    def _followed(self) -> Iterator[tuple[str, set[Subscription]]]:
        """Log key -> its readers, through a shard or fed from the node's worker."""
        for shard in self._shards:
            yield from shard.subs.items()
        if self._feed is not None:
            for rid, subs in self._feed.followed().items():
                yield self._keys.log(rid), subs

    def _all(self) -> Iterator[Subscription]:
        for _key, subs in self._followed():
            yield from subs

    @property
    def shards(self) -> int:
        return len(self._shards)

    async def start(self) -> None:
        """Shards start with their first reader; the keepalive ticker starts now."""
        if self._keepalive_s:
            self._ticker = asyncio.create_task(self._tick(self._keepalive_s), name="keepalive")

    async def stop(self) -> None:
        for task in [self._ticker, *self._reads_back]:
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        await asyncio.gather(*(s.stop() for s in self._shards))

    async def _tick(self, every_s: float) -> None:
        """``IDLE`` to each keepalive reader that got nothing for ``every_s``
        (checked every quarter of it: a keepalive is late by at most that). The logs of
        such idle readers are checked to still exist: one that Redis lost (it restarted
        without its data) gets ``LogLost`` to all of its readers, instead of pings for ever."""
        while True:
            await asyncio.sleep(every_s / 4)
            try:
                await self._tick_once(every_s)
            except Exception as exc:  # noqa: BLE001 - keepalives must go on
                survived("the keepalive ticker", exc)

    async def _tick_once(self, every_s: float) -> None:
        due = time.monotonic() - every_s
        idle: dict[str, set[Subscription]] = {}
        for key, subs in self._followed():
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
        if self._feed is not None and self._feed.owns(request_id):
            self._to_feed(sub)
        else:
            self._to_shard(sub)
        return sub

    def _to_shard(self, sub: Subscription) -> None:
        request_id = sub.request_id
        key = self._keys.log(request_id)
        shard = self._shard_of.get(key)
        if shard is None:
            part = self._keys.partition(request_id)
            shard = next(
                (s for s in self._shards if s.partition == part and len(s.subs) < self._shard_size),
                None,
            )
            if shard is None:
                shard = Shard(
                    self._redis,
                    self._reader,
                    self._keys,
                    part,
                    self._block_ms,
                    self._count,
                    SWEEP_S,
                    self._committer,
                )
                self._shards.append(shard)
            self._shard_of[key] = shard
        shard.add(key, sub)

    def unsubscribe(self, sub: Subscription) -> None:
        if sub.local:
            assert self._feed is not None
            self._feed.detach(sub)
            sub.local = False
            return
        key = self._keys.log(sub.request_id)
        shard = self._shard_of.get(key)
        if shard is not None and not shard.remove(key, sub):
            del self._shard_of[key]

    def interrupt(self) -> None:
        """Wake every interruptible reader with ``Interrupted`` (now and from now on)."""
        self._interrupted = Interrupted("draining")
        for sub in self._all():
            if sub.interruptible:
                sub.queue.put_nowait(self._interrupted)

    # -- the node's readers (``local.py``) ---------------------------------------------

    def to_local(self, request_id: str) -> None:
        """The node's worker writes ``request_id`` now: its readers here leave their shard."""
        shard = self._shard_of.get(self._keys.log(request_id))
        if shard is None:
            return
        for sub in list(shard.subs.get(self._keys.log(request_id), ())):
            self.unsubscribe(sub)
            self._to_feed(sub)

    def to_redis(self, subs: set[Subscription]) -> None:
        """The node's worker let go: these readers follow the log in Redis from where they
        are (a reader handed its log's end is done, and follows nothing)."""
        for sub in subs:
            sub.local = False
            # what was held waits for a read back that has not come: the shard reads it
            # all from the reader's position (offered first, it would skip that read)
            sub.held = None
            if not sub.ended:
                self._to_shard(sub)

    def _to_feed(self, sub: Subscription) -> None:
        """Fed from the worker's appends, after one read of what the log holds past the
        reader's position (what it publishes meanwhile is held, then offered: duplicates
        are dropped by position)."""
        assert self._feed is not None
        sub.local = True
        sub.held = []
        sub.attached += 1
        self._feed.attach(sub)
        task = asyncio.get_running_loop().create_task(
            self._read_back(sub, sub.attached), name="read-back"
        )
        self._reads_back.add(task)
        task.add_done_callback(self._reads_back.discard)

    async def _read_back(self, sub: Subscription, attachment: int) -> None:
        key = self._keys.log(sub.request_id)
        partition = self._keys.partition(sub.request_id)

        def current() -> bool:  # (let go meanwhile, maybe put on the feed again since)
            return sub.local and sub.attached == attachment

        try:
            while current():
                mark = self._committer.mark(partition, self._reader)
                reply = await self._reader.xread({key: str(sub.position)}, count=self._count)
                await self._committer.confirm(partition, mark, self._reader)
                entries = next((e for _k, e in replies.streams_of(reply)), [])
                sub.offer(decoded(entries))
                if len(entries) < self._count:
                    break
        except Exception as exc:  # noqa: BLE001 - a shard reads it, retrying
            survived("a node reader's read back", exc)
            if current():
                assert self._feed is not None
                self._feed.detach(sub)
                self.to_redis({sub})
            return
        if current():
            held, sub.held = sub.held, None
            if held:
                sub.offer(held)
