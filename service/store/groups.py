"""Consumer groups (the queue's ``workers``, the outbox's ``recorders``): made once, and
made again when Redis lost them (a restart without its data answers ``NOGROUP``)."""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError


async def ensure(redis: Redis, stream: str, group: str) -> None:
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


async def read(
    redis: Redis,
    streams: list[str],
    group: str,
    consumer: str,
    *,
    pending: bool,
    count: int,
    block_ms: int,
) -> list[tuple[Any, list[tuple[Any, Any]]]]:
    """``consumer``'s entries of one or more streams (of one slot), as (stream, entries):
    its own unacked ones (``pending``, no wait) or new ones (waiting up to ``block_ms``
    for any); ``[]`` after making a group Redis lost again."""
    ids: dict[Any, Any] = {stream: "0" if pending else ">" for stream in streams}
    try:
        reply: Any = await redis.xreadgroup(
            group, consumer, ids, count=count, block=None if pending else block_ms
        )
    except ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        for stream in streams:
            await ensure(redis, stream, group)
        return []
    return [(key, entries) for key, entries in reply or []]
