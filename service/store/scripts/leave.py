"""``leave.lua``'s face: a reader's connection closed."""

from __future__ import annotations

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.scripts import register
from service.store.scripts.codes import LeaveReply


class Leave:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._script = register(redis, "leave")

    async def __call__(self, rid: str, token: str, now_ms: int, delivered: int) -> tuple[int, str]:
        """The live leases left, and the owner ('' if none, or the request is gone)."""
        keys = [self.keys.meta(rid), self.keys.readers(rid)]
        raw = await self._script(keys=keys, args=[token, now_ms, delivered])
        if LeaveReply(replies.text(raw[0])) == LeaveReply.GONE:
            return 0, ""
        return replies.integer(raw[1]), replies.text(raw[2])
