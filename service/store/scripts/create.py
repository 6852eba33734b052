"""``create.lua``'s face: a request's log, its first reader's lease and its job, at once."""

from __future__ import annotations

import dataclasses
from typing import Any

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.scripts import register
from service.store.scripts.codes import CreateReply
from service.stream.ids import EventId


@dataclasses.dataclass(frozen=True, slots=True)
class Created:
    code: CreateReply
    event_id: EventId | None = None  # the created event's (OK)


class Create:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._script = register(redis, "create")

    async def __call__(
        self,
        request_id: str,
        created: bytes,
        safety_ttl_s: int,
        *,
        grace_ms: int,
        detached: bool,
        lease: tuple[str, int] | None,
        job: bytes,
    ) -> Created:
        k = self.keys
        keys = [k.meta(request_id), k.log(request_id), k.readers(request_id)]
        keys.append(k.queue_of(request_id))
        token, expiry_ms = lease if lease is not None else ("", 0)
        flag = "1" if detached else "0"
        args: list[Any] = [created, safety_ttl_s, grace_ms, flag, token, expiry_ms, job]
        raw = await self._script(keys=keys, args=args)
        code = CreateReply(replies.text(raw[0]))
        if code == CreateReply.OK:
            return Created(code, EventId.from_redis(raw[1]))
        return Created(code)
