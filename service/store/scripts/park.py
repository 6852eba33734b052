"""``park.lua``'s face: the owner gives up a request no reader is left on."""

from __future__ import annotations

import dataclasses
from typing import Any

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.scripts import register
from service.store.scripts.codes import ParkReply


@dataclasses.dataclass(frozen=True, slots=True)
class Parking:
    code: ParkReply
    window_ms: int | None = None  # PARKED: when its resume window is over
    entry_id: bytes | None = None  # CONTINUED: its new queue entry


class Park:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._script = register(redis, "park")

    async def __call__(
        self,
        request_id: str,
        epoch: int,
        entry_id: bytes,
        discarded: int,
        *,
        now_ms: int,
        keep_ms: int,
        wait_ms: int,
    ) -> Parking:
        args: list[Any] = [epoch, entry_id, discarded, now_ms, request_id, keep_ms, wait_ms]
        raw = replies.texts(await self._script(keys=self.keys.parking(request_id), args=args))
        code = ParkReply(raw[0])
        if code == ParkReply.PARKED:
            return Parking(code, window_ms=int(raw[1]))
        if code == ParkReply.CONTINUED:
            return Parking(code, entry_id=raw[1].encode())
        return Parking(code)
