"""Readers of request logs: their leases, their presence, their stream tokens.

Every connected reader holds a lease in the request's ``readers`` sorted set (scored
by expiry). ``Readers`` writes them (``lease_and_unpark.lua``, ``leave.lua``: a reader
that comes back to a parked request makes it go on) and says how far they got;
``Presence`` keeps an API process's leases: it adds one on connect, refreshes all of them
in one pipelined round trip every ``refresh_s``, and removes it on disconnect (recording
when the last reader left). A crashed API process's leases lapse after ``lease_ttl_s``.
A reader proves which stream it may read with a token signed by ``stream_token_secret``.
(The owner's side -- its verdicts, its channel -- is ``owner.py``.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets
import time
import uuid
from collections.abc import Sequence

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.log import Retention
from service.store.pool import STORE_ERRORS, survived
from service.store.scripts.codes import LeaseReply
from service.store.scripts.lease_and_unpark import LeaseAndUnpark
from service.store.scripts.leave import Leave
from service.stream.lifecycle import Meta

log = logging.getLogger(__name__)


def now_ms() -> int:
    return int(time.time() * 1000)


async def stream_token_secret(redis: Redis, keys: Keys) -> bytes:
    """The secret every API process signs stream tokens with: made by the first to ask."""
    await redis.set(keys.stream_token_secret, secrets.token_hex(32), nx=True)
    raw = await redis.get(keys.stream_token_secret)
    return replies.text(raw).encode()


@dataclasses.dataclass(frozen=True, slots=True)
class Delivery:
    """How far a request's readers got, for the waste count at its end."""

    delivered: int  # the most completion tokens any reader's connection was sent
    present: bool  # a reader holds a live lease now


class Readers:
    """The readers' leases of every request, bound to a client."""

    def __init__(self, redis: Redis, keys: Keys, retention: Retention | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.retention = retention or Retention()
        self._lease = LeaseAndUnpark(redis, keys)
        self._leave = Leave(redis, keys)

    async def lease(
        self, leases: Sequence[tuple[str, str, int]], expiry_ms: int
    ) -> list[LeaseReply]:
        """Write (or refresh) leases -- (request id, reader token, tokens delivered) --
        in one pipelined round trip. Each answers ENDED (the request ended or is gone),
        LEASED, or UNPARKED: the request was parked, and goes on now
        (``lease_and_unpark.lua``)."""
        return await self._lease(
            leases,
            expiry_ms,
            now_ms=now_ms(),
            keep_ms=self.retention.running_ttl_s * 1000,
            wait_ms=self.retention.worker_wait_s * 1000,
        )

    async def leave(self, rid: str, token: str, delivered: int) -> int:
        """Drop a lease; returns how many live leases are left. When none is, the owner
        is nudged so that it times the grace period from now instead of polling for it."""
        left, owner_id = await self._leave(rid, token, now_ms(), delivered)
        if left == 0 and owner_id:
            await self.redis.publish(self.keys.control(owner_id), f"check:{rid}")
        return left

    async def delivery(self, rid: str) -> Delivery:
        pipe = self.redis.pipeline(transaction=False)
        pipe.hget(self.keys.meta(rid), Meta.DELIVERED)
        pipe.zcount(self.keys.readers(rid), now_ms(), "+inf")
        delivered, present = await pipe.execute()
        return Delivery(replies.integer(delivered), replies.integer(present) > 0)


@dataclasses.dataclass(slots=True, eq=False)
class Lease:
    """One reader's presence on one request."""

    presence: Presence
    request_id: str
    token: str
    delivered: int = 0  # completion tokens written to this reader's connection
    # A lease taken before its reader runs (the API takes it before enqueueing) is
    # refreshed only once the reader adopts it; a reader that never starts (the client
    # left before the response began) lets it lapse after one lease TTL.
    adopted: bool = False
    taken_ms: int = 0
    # the reader got the terminal event: the request is over, its readers set gone with
    # it (the end's script drops it), so releasing the lease needs no round trip
    ended: bool = False
    unparked: bool = False  # taking it made the parked request go on

    async def release(self) -> None:
        await self.presence.release(self)


def _log_failed_leave(task: asyncio.Future[int]) -> None:
    """A leave that failed (the lease lapses by itself), whether or not its reader still
    waited for it: never a task exception nobody retrieved."""
    if not task.cancelled() and task.exception() is not None:
        log.warning("could not release a lease: %s", task.exception())


class Presence:
    """An API process's leases: tracked here, written through ``readers``."""

    def __init__(self, readers: Readers, *, lease_ttl_s: float, refresh_s: float) -> None:
        """``lease_ttl_s``, ``refresh_s``: Settings' ``lease_ttl_s``, ``lease_refresh_s``."""
        self.readers = readers
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.refresh_s = refresh_s
        self._leases: set[Lease] = set()
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._leases)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="presence")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def track(self, request_id: str, *, adopted: bool = True) -> Lease:
        """A lease this process refreshes; the caller writes it to Redis (``acquire``, or
        ``RedisLog.create`` together with the log)."""
        lease = Lease(self, request_id, uuid.uuid4().hex, adopted=adopted, taken_ms=now_ms())
        self._leases.add(lease)
        return lease

    def forget(self, lease: Lease) -> None:
        self._leases.discard(lease)

    async def acquire(self, request_id: str) -> Lease:
        """A reader's lease; a reader that comes back to a parked request makes it go on
        (``lease.unparked``)."""
        lease = self.track(request_id)
        try:
            [answer] = await self.readers.lease([(request_id, lease.token, 0)], self.expiry_ms())
        except BaseException:  # not written (or cancelled): never refresh it
            self.forget(lease)
            raise
        lease.unparked = answer == LeaseReply.UNPARKED
        return lease

    async def release(self, lease: Lease) -> None:
        if lease not in self._leases:
            return
        self._leases.discard(lease)
        if lease.ended:
            return
        leaving = asyncio.ensure_future(
            self.readers.leave(lease.request_id, lease.token, lease.delivered)
        )
        leaving.add_done_callback(_log_failed_leave)  # (an error after a cancelled wait)
        # shielded: a reader's task is often being cancelled (client gone) right now; a
        # failure is the callback's to log (the lease lapses by itself)
        with contextlib.suppress(*STORE_ERRORS):
            await asyncio.shield(leaving)

    def expiry_ms(self) -> int:
        return now_ms() + self.lease_ttl_ms

    async def refresh(self) -> None:
        stale = now_ms() - self.lease_ttl_ms
        for lease in [le for le in self._leases if not le.adopted and le.taken_ms < stale]:
            self._leases.discard(lease)  # never adopted: it has lapsed in Redis
        leases = [(le.request_id, le.token, le.delivered) for le in self._leases if le.adopted]
        await self.readers.lease(leases, self.expiry_ms())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_s)
            try:
                await self.refresh()
            except Exception as exc:  # noqa: BLE001 - a lapsed lease parks a read request
                survived("refreshing the readers' leases", exc)
