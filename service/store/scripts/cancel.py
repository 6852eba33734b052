"""``cancel.lua``'s face: a request cancelled in any phase."""

from __future__ import annotations

import dataclasses
from typing import Any

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.scripts import register
from service.store.scripts.codes import CancelReply
from service.stream import events as ev
from service.stream.endings import Ending
from service.stream.lifecycle import State


@dataclasses.dataclass(frozen=True, slots=True)
class CancelOutcome:
    outcome: CancelReply | State  # or the terminal state it reached (CANCELLED: here)
    detail: str | None = None  # end id (cancelled here) or owner (cancelling)


def _outcome(raw: str) -> CancelReply | State:
    try:
        return CancelReply(raw)
    except ValueError:
        return State(raw)


class Cancel:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._script = register(redis, "cancel")

    async def __call__(
        self, rid: str, queued: Ending, parked: tuple[Ending, int] | None, ttl_s: int
    ) -> CancelOutcome:
        k = self.keys
        keys = [k.meta(rid), k.log(rid), k.outbox_of(rid), k.scratch(rid), k.tails(rid)]
        keys.append(k.parked_of(rid))
        [end] = queued.events
        args: list[Any] = [ev.encode(end), ttl_s, ev.encode_summary(queued.summary)]
        if parked is None:
            args += ["", "", 0]
        else:
            ending, events = parked
            [parked_end] = ending.events
            args += [ev.encode(parked_end), ev.encode_summary(ending.summary), events]
        args.append(rid)
        parts = replies.texts(await self._script(keys=keys, args=args))
        return CancelOutcome(_outcome(parts[0]), parts[1] if len(parts) > 1 else None)
