"""Cancel, reader leases and the owner's decisions: the control scripts, bound to a client.

* ``cancel`` ends a queued request on the spot (no engine ever sees it) or flags a
  running one and tells its owner over the owner's control channel.
* ``lease`` / ``leave`` write a reader's presence (``service/store/presence.py``
  keeps an API process's leases alive).
* ``check`` is the owner's periodic question for its running requests: keep going,
  cancelled, or abandoned (no lease for longer than the grace period) -- a
  ``Verdict``, or the milliseconds left until abandonment.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from service.store import replies
from service.store.keys import Keys
from service.store.limits import free_slots
from service.store.log import Retention
from service.store.pool import relearn, survived
from service.store.scripts.cancel import Cancel, CancelOutcome
from service.store.scripts.codes import CancelReply, LeaseReply
from service.store.scripts.lease_and_unpark import LeaseAndUnpark
from service.store.scripts.leave import Leave
from service.store.scripts.owner_verdicts import OwnerVerdicts
from service.stream.endings import Ending
from service.stream.lifecycle import Meta, State

log = logging.getLogger(__name__)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclasses.dataclass(frozen=True, slots=True)
class Delivery:
    """How far a request's readers got, for the waste count at its end."""

    delivered: int  # the most completion tokens any reader's connection was sent
    present: bool  # a reader holds a live lease now


class Control:
    def __init__(self, redis: Redis, keys: Keys, retention: Retention | None = None) -> None:
        self.redis = redis
        self.keys = keys
        self.retention = retention or Retention()
        self._lease = LeaseAndUnpark(redis, keys)
        self._leave = Leave(redis, keys)
        self._check = OwnerVerdicts(redis, keys)
        self._cancel = Cancel(redis, keys)

    async def cancel(
        self, rid: str, queued: Ending, parked: tuple[Ending, int] | None = None
    ) -> CancelOutcome:
        """``queued``: the request's ending if it is still queued; ``parked``: its ending
        if it is parked, and the entries of the log that ending was made from (``stale``
        when the log has others by now). ``cancel.lua`` writes the one that applies, with
        its outbox entry; its TTL and admission slot from it, as ``RedisLog.end``."""
        summary = queued.summary
        outcome = await self._cancel(rid, queued, parked, self.retention.ttl_s(summary))
        if outcome.outcome == State.CANCELLED and outcome.detail and summary.tenant is not None:
            inflight = self.keys.inflight_of(summary.tenant, summary.api_key_id)
            await free_slots(self.redis, [(inflight, rid)])  # ended here
        if outcome.outcome == CancelReply.CANCELLING and outcome.detail:
            await self.redis.publish(self.keys.control(outcome.detail), f"cancel:{rid}")
        return outcome

    async def check(self, rids: Sequence[str], park_after_ms: int = -1) -> dict[str, int]:
        """One pipelined round trip: the verdict for each of the owner's requests
        (``park_after_ms``: no reader this long parks a request; -1: never)."""
        if not rids:
            return {}
        return await self._check(rids, now_ms(), park_after_ms)

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

    async def messages(
        self, worker_id: str, *, silent_s: float = 2.0
    ) -> AsyncIterator[tuple[str, str]]:
        """``(verb, request id)`` published to a worker's channel (``cancel``, ``check``),
        for ever. After a failure the subscription is made again (the slot map learnt
        again first: its node may be gone); the owner's periodic check covers what was
        published meanwhile. The subscription is pinged every half ``silent_s`` and given
        up when its node answered nothing for ``silent_s`` (frozen, partitioned)."""
        channel = self.keys.control(worker_id)
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                async for data in _listened(pubsub, silent_s):
                    verb, _, rid = replies.text(data).partition(":")
                    yield verb, rid
            except Exception as exc:  # noqa: BLE001 - the channel must go on
                survived("the control channel (subscribing again)", exc)
                await relearn(self.redis, channel, silent_s + 1.0)
                await asyncio.sleep(0.2)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await pubsub.aclose()


async def _listened(pubsub: PubSub, silent_s: float) -> AsyncIterator[Any]:
    """The data of the messages a subscription receives; raises once its node answered
    nothing (no message, no pong) for ``silent_s``."""
    heard = time.monotonic()
    while True:
        message = await pubsub.get_message(timeout=silent_s / 2)
        if message is None:
            if time.monotonic() - heard >= silent_s:
                raise RedisConnectionError(
                    f"the control channel's node answered nothing for {silent_s:g} s"
                )
            await pubsub.ping()
            continue
        heard = time.monotonic()
        if message.get("type") == "message":
            yield message["data"]
