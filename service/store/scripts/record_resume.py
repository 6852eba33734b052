"""``record_resume.lua``'s face: a continuing owner's re-prefill, and the recovery counts."""

from __future__ import annotations

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.scripts import register
from service.store.scripts.codes import ResumeReply
from service.stream.endings import Recovery


class RecordResume:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._script = register(redis, "record_resume")

    async def __call__(self, request_id: str, epoch: int, reprefill_tokens: int) -> Recovery | None:
        """The request's recovery counts, this continuation's included; None: the caller
        (``epoch``) is not its owner (``ResumeReply.FENCED``)."""
        raw = await self._script(keys=[self.keys.meta(request_id)], args=[epoch, reprefill_tokens])
        if ResumeReply(replies.text(raw[0])) == ResumeReply.FENCED:
            return None
        return Recovery(*(replies.integer(x) for x in raw[1:]))
