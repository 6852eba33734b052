"""``append.lua``'s face: fenced appends of many requests of one queue, in one call."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys
from service.store.scripts import register
from service.store.scripts.codes import AppendReply
from service.stream import events as ev
from service.stream.ids import EventId


@dataclasses.dataclass(slots=True)
class Append:
    """One request's events for ``RedisLog.append_many``."""

    request_id: str
    epoch: int
    events: Sequence[ev.Event]
    terminal_state: str = ""
    ttl_s: int = 0
    summary: bytes = b""
    expect: int | None = None  # entries the log holds before these (None: no check)
    # the API key's in-flight set whose slot the terminal event frees (``RedisLog.closing``;
    # not in the script: the set is in another cluster slot)
    inflight_key: str = ""
    ack: bytes = b""  # the queue entry to acknowledge (and delete) with the terminal event


@dataclasses.dataclass(frozen=True, slots=True)
class Appended:
    """One request's answer: its entry ids (OK), or why nothing was written."""

    code: AppendReply
    ids: list[EventId]
    detail: str = ""

    def __str__(self) -> str:
        return f"{self.code} {self.detail}"


class AppendScript:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.keys = keys
        self._script = register(redis, "append")

    @property
    def sha(self) -> str:
        return str(self._script.sha)

    async def __call__(self, queue: str, items: Sequence[Append]) -> list[Appended]:
        """``items``, all of one partition and of ``queue`` (their lane's)."""
        partition = self.keys.partition(items[0].request_id)
        keys: list[str] = [self.keys.outbox(partition), queue]
        args: list[bytes | str | int] = []
        for item in items:
            keys += self.keys.appended(item.request_id)
            args += [
                str(item.epoch),
                "" if item.expect is None else item.expect,
                item.terminal_state,
                item.ttl_s,
                item.summary,
                item.ack,
                len(item.events),
            ]
            args.extend(ev.encode(e) for e in item.events)
        raw = await self._script(keys=keys, args=args)  # reloads the script if need be
        out: list[Appended] = []
        for reply in raw:
            code = AppendReply(replies.text(reply[0]))
            if code == AppendReply.OK:
                out.append(Appended(code, [EventId.from_redis(r) for r in reply[1:]]))
            else:
                out.append(Appended(code, [], replies.text(reply[1])))
        return out
