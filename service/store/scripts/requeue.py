"""``requeue.lua``'s face: a job queued again behind a new entry."""

from __future__ import annotations

import dataclasses

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import QUEUE_GROUP, Keys
from service.store.scripts import register
from service.store.scripts.codes import RequeueReply
from service.stream.lifecycle import Requeue


@dataclasses.dataclass(frozen=True, slots=True)
class Requeued:
    """What ``RequestQueue.requeue`` did: the new entry, or (``exhausted``: how many
    takeovers the request had) nothing because it was lost too often, or neither."""

    entry_id: bytes | None
    exhausted: int | None


class RequeueScript:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._script = register(redis, "requeue")

    async def __call__(
        self,
        request_id: str,
        entry_id: bytes,
        why: Requeue,
        *,
        max_takeovers: int,
        epoch: int | None,
        wait_until_ms: int,
    ) -> Requeued:
        k = self.keys
        raw = await self._script(
            keys=[k.meta(request_id), k.queue_of(request_id), k.orphans_of(request_id)],
            args=[
                entry_id,
                QUEUE_GROUP,
                str(why),
                max_takeovers,
                "" if epoch is None else epoch,
                request_id,
                wait_until_ms,
            ],
        )
        code = RequeueReply(replies.text(raw[0]))
        if code == RequeueReply.EXHAUSTED:
            return Requeued(None, replies.integer(raw[1]))
        if code == RequeueReply.OK:
            return Requeued(replies.text(raw[1]).encode(), None)
        return Requeued(None, None)
