"""Consumer groups (the queue's ``workers``, the outbox's ``recorders``): made once, and
made again when Redis lost them (a restart without its data answers ``NOGROUP``)."""

from __future__ import annotations

import time
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError


async def ensure(redis: Redis, stream: str, group: str) -> None:
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


# A read for new entries that returns this much later than its block may have lost a reply:
# the client sends a command again after a timeout (``pool._retry``), and when the first
# reply did come (a process frozen past its socket timeout, a node silent for a while) Redis
# counts its entries delivered -- they wait in the consumer's own pending list, where only
# a read of that list (or another consumer's XAUTOCLAIM, 30 s later) finds them.
LATE_S = 1.0


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
    for any, and its own unacked ones too when the wait ran late: ``LATE_S``); ``[]``
    after making a group Redis lost again."""
    block = None if pending else block_ms
    started = time.monotonic()
    found = await _read(redis, streams, group, consumer, count, block)
    if block is None or time.monotonic() - started <= block / 1000 + LATE_S:
        return found
    own = await _read(redis, streams, group, consumer, count, None)
    return merged(own, found)


def merged(
    first: list[tuple[Any, list[tuple[Any, Any]]]], then: list[tuple[Any, list[tuple[Any, Any]]]]
) -> list[tuple[Any, list[tuple[Any, Any]]]]:
    """Two replies as one: each stream's entries of ``first``, then those of ``then`` that
    ``first`` does not hold (by id)."""
    out: dict[Any, list[tuple[Any, Any]]] = {}
    for stream, entries in [*first, *then]:
        held = out.setdefault(stream, [])
        ids = {entry_id for entry_id, _ in held}
        held.extend(e for e in entries if e[0] not in ids)
    return [(stream, entries) for stream, entries in out.items() if entries]


async def _read(
    redis: Redis, streams: list[str], group: str, consumer: str, count: int, block: int | None
) -> list[tuple[Any, list[tuple[Any, Any]]]]:
    """One ``XREADGROUP``: new entries, waiting up to ``block`` ms; ``None``: the
    consumer's own pending entries."""
    ids: dict[Any, Any] = {stream: "0" if block is None else ">" for stream in streams}
    try:
        reply: Any = await redis.xreadgroup(group, consumer, ids, count=count, block=block)
    except ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        for stream in streams:
            await ensure(redis, stream, group)
        return []
    return [(key, entries) for key, entries in reply or []]
