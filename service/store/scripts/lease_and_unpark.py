"""``lease_and_unpark.lua``'s face: readers' leases written (a parked request goes on)."""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.scripts import register, run_pipelined
from service.store.scripts.codes import LeaseReply


class LeaseAndUnpark:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._script = register(redis, "lease_and_unpark")

    async def __call__(
        self,
        leases: Sequence[tuple[str, str, int]],
        expiry_ms: int,
        *,
        now_ms: int,
        keep_ms: int,
        wait_ms: int,
    ) -> list[LeaseReply]:
        """(request id, reader token, tokens delivered) each, in one pipelined round trip."""
        calls = [
            (self.keys.parking(rid), [token, expiry_ms, delivered, now_ms, rid, keep_ms, wait_ms])
            for rid, token, delivered in leases
        ]
        if not calls:
            return []
        raw = await run_pipelined(self.redis, self._script, calls)
        return [LeaseReply(replies.integer(r)) for r in raw]
