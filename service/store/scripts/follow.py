"""``follow.lua``'s face: a tail shard follows some logs and leaves others, in one step."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from redis.asyncio import Redis

from service.store.keys import Keys
from service.store.scripts import register


class Follow:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._script = register(redis, "follow")

    async def __call__(
        self, wake_key: str, follow: Sequence[tuple[str, str]], leave: Iterable[str]
    ) -> None:
        """``follow``: (request id, log key) pairs; ``leave``: the tails sets of logs."""
        keys = [wake_key]
        for rid, log_key in follow:
            keys += [self.keys.meta(rid), self.keys.tails(rid), log_key]
        keys += leave
        await self._script(keys=keys, args=[len(follow)])
