"""``admit.lua``'s face: a request counted against its key's limits, or refused."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.scripts import register
from service.store.scripts.codes import Admitted


class Admit:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._script = register(redis, "admit")

    async def __call__(
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
        by the request's ending (``admission.free_slots``)."""
        keys = [self.keys.inflight(who), self.keys.rate(who, now_ms // 60_000)]
        args: list[Any] = [now_ms, max_in_flight, per_minute, request_id, slot_expiry_ms]
        verdict, *rest = await self._script(keys=keys, args=args)
        return Admitted(replies.integer(verdict)), replies.integer(rest[0] if rest else 0)
