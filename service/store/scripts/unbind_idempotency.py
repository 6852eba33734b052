"""``unbind_idempotency.lua``'s face: an ``Idempotency-Key`` freed of a refused request."""

from __future__ import annotations

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.scripts import register
from service.store.scripts.codes import UnbindReply


class UnbindIdempotency:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._script = register(redis, "unbind_idempotency")

    async def __call__(self, principal: str, key: str, request_id: str) -> UnbindReply:
        name = self.keys.idempotency(principal, key)
        return UnbindReply(replies.text(await self._script(keys=[name], args=[request_id])))
