"""A running request's owner: its periodic verdicts and its control channel.

* ``check`` is the owner's periodic question for its running requests
  (``owner_verdicts.lua``): keep going, cancelled, parked or abandoned (no lease for
  the park delay, or the whole resume window) -- a ``Verdict``, or the milliseconds left.
* ``messages`` are what the API publishes to the owner's channel: ``cancel`` (a cancel
  of a running request: ``RedisLog.cancel``) and ``check`` (its last reader left).
(The readers' side -- leases, presence -- is ``readers.py``.)
"""

from __future__ import annotations

import asyncio
import contextlib
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
from service.store.pool import relearn, survived
from service.store.readers import now_ms
from service.store.scripts.owner_verdicts import OwnerVerdicts

log = logging.getLogger(__name__)


class OwnerChannel:
    """An owner's questions about its running requests, and what it is told."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._check = OwnerVerdicts(redis, keys)

    async def check(self, rids: Sequence[str], park_after_ms: int = -1) -> dict[str, int]:
        """One pipelined round trip: the verdict for each of the owner's requests
        (``park_after_ms``: no reader this long parks a request; -1: never)."""
        if not rids:
            return {}
        return await self._check(rids, now_ms(), park_after_ms)

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
