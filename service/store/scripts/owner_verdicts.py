"""``owner_verdicts.lua``'s face: the owner's periodic decision for its running requests."""

from __future__ import annotations

from collections.abc import Sequence

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.scripts import register, run_pipelined


class OwnerVerdicts:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys
        self._script = register(redis, "owner_verdicts")

    async def __call__(
        self, rids: Sequence[str], now_ms: int, park_after_ms: int
    ) -> dict[str, int]:
        """A ``Verdict`` per request, or -N: no live lease, parked or abandoned in N ms
        unless a reader returns. One call per partition (a cluster slot), pipelined."""
        by_partition: dict[int, list[str]] = {}
        for rid in rids:
            by_partition.setdefault(self.keys.partition(rid), []).append(rid)
        calls = [
            (
                [k for r in part for k in (self.keys.meta(r), self.keys.readers(r))],
                [now_ms, park_after_ms],
            )
            for part in by_partition.values()
        ]
        results = await run_pipelined(self.redis, self._script, calls)
        return {
            r: replies.integer(x)
            for part, verdicts in zip(by_partition.values(), results, strict=True)
            for r, x in zip(part, verdicts, strict=True)
        }
