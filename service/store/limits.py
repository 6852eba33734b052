"""Per-key limits in Redis, across API replicas: requests in flight and per minute."""

from __future__ import annotations

import logging
from collections.abc import Sequence

from redis.asyncio import Redis

from service.store.keys import Keys
from service.store.pool import STORE_ERRORS
from service.store.scripts.admit import Admit
from service.store.scripts.codes import Admitted

__all__ = ["Admitted", "Limits", "free_slots"]

log = logging.getLogger(__name__)


async def free_slots(redis: Redis, ended: Sequence[tuple[str, str]]) -> None:
    """Free ended requests' admission slots -- (in-flight set, request id) -- in one
    pipelined round trip. (Idempotent: the recorder frees them again.)"""
    pipe = redis.pipeline(transaction=False)
    for inflight_key, rid in ended:
        pipe.zrem(inflight_key, rid)
    try:
        await pipe.execute()
    except STORE_ERRORS as exc:  # the ends are written: the recorder frees them
        log.warning("cannot free admission slots: %s", exc)


class Limits:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._admit = Admit(redis, keys)

    async def admit(
        self,
        who: str,
        request_id: str,
        *,
        now_ms: int,
        max_in_flight: int,
        per_minute: int,
        slot_expiry_ms: int,
    ) -> tuple[Admitted, int]:
        """Count the request against ``who``'s limits (0: none); returns the verdict and,
        when refused, the milliseconds until it may try again. The in-flight slot is freed
        by the script that writes the request's terminal event."""
        return await self._admit(
            who,
            request_id,
            now_ms=now_ms,
            max_in_flight=max_in_flight,
            per_minute=per_minute,
            slot_expiry_ms=slot_expiry_ms,
        )

    async def hold(self, who: str, request_id: str, *, slot_expiry_ms: int) -> None:
        """Count a request that goes on again (a reader came back to it parked) in flight,
        without a check: it was admitted once, and is never refused now."""
        await self.redis.zadd(self.keys.inflight(who), {request_id: slot_expiry_ms})
