"""``claim.lua``'s face: ownership of a request (its epoch), with its log's ``created``."""

from __future__ import annotations

import dataclasses

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.scripts import register
from service.store.scripts.codes import ClaimReply
from service.stream import events as ev
from service.stream.ids import EventId


@dataclasses.dataclass(frozen=True, slots=True)
class Claimed:
    code: ClaimReply
    epoch: int = 0
    events: int = 0  # entries in the log
    first: tuple[EventId, ev.Created] | None = None  # the log's ``created``, if it starts so


class Claim:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._script = register(redis, "claim")

    async def __call__(self, request_id: str, worker_id: str, entry: str) -> Claimed:
        keys = [self.keys.meta(request_id), self.keys.log(request_id)]
        raw = await self._script(keys=keys, args=[worker_id, entry])
        code = ClaimReply(replies.text(raw[0]))
        if code != ClaimReply.OK:
            return Claimed(code)
        first: tuple[EventId, ev.Created] | None = None
        if len(raw) > 4:
            event = ev.decode(raw[4])
            if isinstance(event, ev.Created):
                first = (EventId.from_redis(raw[3]), event)
        return Claimed(code, replies.integer(raw[1]), replies.integer(raw[2]), first)
