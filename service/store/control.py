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

from service.store import replies, scripts
from service.store.keys import Keys
from service.store.limits import free_slots
from service.store.log import Retention
from service.store.pool import relearn, survived
from service.stream import events as ev
from service.stream.endings import Ending
from service.stream.lifecycle import Meta, State

log = logging.getLogger(__name__)


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclasses.dataclass(frozen=True, slots=True)
class CancelOutcome:
    outcome: str  # missing | cancelled | cancelling | <terminal state already reached>
    detail: str | None = None  # end id (cancelled while queued) or owner (cancelling)


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
        self._lease = scripts.register(redis, "lease")
        self._leave = scripts.register(redis, "leave")
        self._check = scripts.register(redis, "check")
        self._cancel = scripts.register(redis, "cancel")

    def _keys(self, rid: str) -> list[str]:
        return [self.keys.meta(rid), self.keys.readers(rid)]

    async def cancel(
        self, rid: str, queued: Ending, parked: tuple[Ending, int] | None = None
    ) -> CancelOutcome:
        """``queued``: the request's ending if it is still queued; ``parked``: its ending
        if it is parked, and the entries of the log that ending was made from (``stale``
        when the log has others by now). ``cancel.lua`` writes the one that applies, with
        its outbox entry; its TTL and admission slot from it, as ``RedisLog.end``."""
        summary = queued.summary
        keys = [
            self.keys.meta(rid),
            self.keys.log(rid),
            self.keys.outbox_of(rid),
            self.keys.scratch(rid),
            self.keys.tails(rid),
            self.keys.parked_of(rid),
        ]
        [end] = queued.events
        ttl_s = self.retention.ttl_s(summary)
        args: list[Any] = [ev.encode(end), ttl_s, ev.encode_summary(summary)]
        if parked is None:
            args += ["", "", 0]
        else:
            ending, events = parked
            [parked_end] = ending.events
            args += [ev.encode(parked_end), ev.encode_summary(ending.summary), events]
        args.append(rid)
        parts = replies.texts(await self._cancel(keys=keys, args=args))
        outcome = CancelOutcome(parts[0], parts[1] if len(parts) > 1 else None)
        if outcome.outcome == State.CANCELLED and outcome.detail and summary.tenant is not None:
            inflight = self.keys.inflight_of(summary.tenant, summary.api_key_id)
            await free_slots(self.redis, [(inflight, rid)])  # ended here
        if outcome.outcome == "cancelling" and outcome.detail:
            await self.redis.publish(self.keys.control(outcome.detail), f"cancel:{rid}")
        return outcome

    async def check(self, rids: Sequence[str], park_after_ms: int = -1) -> dict[str, int]:
        """One pipelined round trip: the verdict for each of the owner's requests
        (``park_after_ms``: no reader this long parks a request; -1: never)."""
        if not rids:
            return {}
        now = now_ms()
        by_partition: dict[int, list[str]] = {}
        for rid in rids:  # one call per partition (a cluster slot), for all of its requests
            by_partition.setdefault(self.keys.partition(rid), []).append(rid)
        calls = [
            ([k for r in part for k in self._keys(r)], [now, park_after_ms])
            for part in by_partition.values()
        ]
        results = await scripts.run_pipelined(self.redis, self._check, calls)
        return {
            r: replies.integer(x)
            for part, verdicts in zip(by_partition.values(), results, strict=True)
            for r, x in zip(part, verdicts, strict=True)
        }

    async def lease(self, leases: Sequence[tuple[str, str, int]], expiry_ms: int) -> list[int]:
        """Write (or refresh) leases -- (request id, reader token, tokens delivered) --
        in one pipelined round trip. Each answers 0 (the request ended or is gone), 1, or
        2: the request was parked, and goes on now (``lease.lua``)."""
        now = now_ms()
        keep_ms = self.retention.running_ttl_s * 1000
        wait_ms = self.retention.worker_wait_s * 1000
        calls = [
            (self.keys.parking(rid), [token, expiry_ms, delivered, now, rid, keep_ms, wait_ms])
            for rid, token, delivered in leases
        ]
        if not calls:
            return []
        return [
            replies.integer(r) for r in await scripts.run_pipelined(self.redis, self._lease, calls)
        ]

    async def leave(self, rid: str, token: str, delivered: int) -> int:
        """Drop a lease; returns how many live leases are left. When none is, the owner
        is nudged so that it times the grace period from now instead of polling for it."""
        left, owner = await self._leave(keys=self._keys(rid), args=[token, now_ms(), delivered])
        owner_id = replies.text(owner)
        if replies.integer(left) == 0 and owner_id:
            await self.redis.publish(self.keys.control(owner_id), f"check:{rid}")
        return replies.integer(left)

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
