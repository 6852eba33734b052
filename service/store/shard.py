"""One tail shard: the followers of a set of logs of one partition, over one Redis
connection (``tail.py``'s ``LogTailer`` makes them)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from typing import Any

from redis.asyncio import Redis

from service.store import replies
from service.store.commit import Committer
from service.store.keys import LOG_FIELD, Keys
from service.store.mailbox import Batch, Subscription
from service.store.pool import STORE_ERRORS, Backoff, survived
from service.store.scripts.follow import Follow
from service.stream import events as ev
from service.stream.ids import EventId

log = logging.getLogger(__name__)

WAKE_COUNT = 10_000  # wake entries taken in one read
STOP_WAIT_S = 2.0  # a stopping shard waits this long for its loop to end
# a failed read is tried again after this long, doubled up to the cap: small, so that a
# shard follows a failover within a fraction of a second of the slot map's change (a read
# against a dead node fails at once; one against a frozen node waits its socket timeout)
BACKOFF_S = (0.05, 0.5)
# one turn of the loop (a read and its commit barrier, or a registration) that takes this
# much longer than its own waits is stuck -- every socket has a timeout, so it should not
# be; it is given up, said where, and the shard goes on as after a store error
STUCK_MARGIN_S = 10.0


class Shard:
    """The followers of a set of logs of one partition, over one Redis connection.

    Appends notify: a shard registers its wake stream in each followed log's ``tails``
    set, and every append to the log adds the log's key to the wake streams there. The
    shard blocks reading its wake stream alone, then reads only the logs named, from its
    slowest reader's position: a read costs O(logs that changed), not O(logs followed).
    (With the old one ``XREAD BLOCK`` over every followed log, Redis's cost per read grew
    with the shard: 109 us per read of 50 logs, the largest command cost per token.)

    A notification can be lost -- a registration Redis lost (a restart, a failover), a
    wake stream that outran its cap while the shard did not read -- so the shard also
    reads all its logs every ``sweep_s``, and registers them all again after a store
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
        sweep_s: float,
        committer: Committer,
    ) -> None:
        self._redis = redis
        self._reader = reader
        self._keys = keys
        self._block_ms = block_ms
        self._count = count
        self._sweep_s = sweep_s
        self._committer = committer
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
        self._follow = Follow(redis, keys)
        self._task = asyncio.get_running_loop().create_task(self._run(), name="log-tailer")
        self.reads = 0
        self.stuck_s = block_ms / 1000 + committer.timeout_ms / 1000 + STUCK_MARGIN_S
        self._doing = "starting"  # what the loop waits on (said when it is stuck)

    async def stop(self) -> None:
        self._task.cancel()
        # (bounded: a read the client does not give up on at once must not hold the
        # process's shutdown; seen after a read that failed with a client error)
        await asyncio.wait({self._task}, timeout=STOP_WAIT_S)
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
        try:
            await self._follow(
                self._wake_key, [(self._rids[key], key) for key in register], leave.values()
            )
        except Exception as exc:  # noqa: BLE001 - the loop registers all again
            survived("tail registration", exc)
            self._reregister = True

    async def _run(self) -> None:
        backoff = Backoff(*BACKOFF_S)
        while True:
            timer = asyncio.timeout(self.stuck_s)
            try:
                async with timer:
                    reply = await self._turn()
                if reply is None:
                    continue
                self.reads += 1
                backoff.succeeded()
            except Exception as exc:  # noqa: BLE001 - a shard's readers must not be left
                err: Exception = exc
                if timer.expired():
                    err = Stuck(f"{self._doing} took over {self.stuck_s:g} s")
                survived(f"log tail read (retrying in {backoff.next_s:.2f} s)", err)
                self._reregister = True
                await backoff.wait()
                continue
            for _key, entries in replies.streams_of(reply):
                self._woken(entries)

    async def _turn(self) -> Any:
        """One turn of the loop: registrations again after an error, the logs that changed
        (then None), or a blocked read of the wake stream (its reply)."""
        if self._reregister:
            self._reregister = False
            self._register |= set(self._rids)
            self._dirty |= set(self._positions)
            self._doing = "registering again"
            await self._send()
        if time.monotonic() - self._swept >= self._sweep_s:
            self._swept = time.monotonic()
            self._dirty |= set(self._positions)
        if self._dirty:
            await self._read_changed()
            return None
        sweep_in = self._sweep_s - (time.monotonic() - self._swept)
        block = max(1, min(self._block_ms, int(sweep_in * 1000) + 1))
        self._doing = "the wake stream's read"
        return await self._reader.xread(
            {self._wake_key: self._wake_last}, count=WAKE_COUNT, block=block
        )

    def _woken(self, entries: list[list[Any]]) -> None:
        """The wake stream's entries: the logs named are to be read."""
        if not entries:
            return
        self._wake_last = entries[-1][0]
        for _eid, fields in entries:  # (an append names every log it changed at once)
            for key in replies.stream_fields(fields, LOG_FIELD):
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
            mark = self._committer.mark(self.partition, self._reader)
            self._doing = "a read of the logs"
            reply: Any = await self._reader.xread(names, count=self._count)
            # nothing goes out before it is committed (``commit.py``)
            self._doing = "the commit barrier"
            await self._committer.confirm(self.partition, mark, self._reader)
        except BaseException:
            self._dirty |= set(keys)  # read them when the store answers again
            raise
        self.reads += 1
        for raw_key, entries in replies.streams_of(reply):
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
        batch = decoded(entries)
        if batch and isinstance(batch[-1][1], ev.End):
            self._ended.add(key)
        for sub in list(subs):
            # A reader that subscribed (further back) while this read was in flight would
            # see a gap; it gets these entries from the next read, which starts at its position.
            if sub.position >= start:
                sub.offer(batch)
        self._reposition(key)


def decoded(entries: list[list[Any]]) -> Batch:
    """A log's entries as Redis sent them (``[[id, [field, value, ...]], ...]``): a batch."""
    return [
        (EventId.from_redis(eid), ev.decode(replies.event_payload(fields)))
        for eid, fields in entries
    ]


class Stuck(Exception):
    """A turn of a shard's loop waited past every socket's timeout (``STUCK_MARGIN_S``)."""
