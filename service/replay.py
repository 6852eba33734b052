"""Replay a request's answer exactly as clients received it, for audit.

The source is the hot log, or the Postgres archive once the hot log is gone; the
bytes are rendered by the same code as the live stream, and the original timing
comes from the event ids (milliseconds since the epoch).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from service.db.ledger import Ledger
from service.redis_log import RedisLog
from service.stream import archive
from service.stream.events import Created, Delta, Event
from service.stream.ids import EventId
from service.stream.render import ChunkRenderer, sse_event_frames


class NotFoundError(LookupError):
    pass


async def load(log: RedisLog, ledger: Ledger | None, rid: str) -> list[tuple[EventId, Event]]:
    entries = await log.read(rid)
    if entries:
        return entries
    blob = await ledger.archive(rid) if ledger is not None else None
    if blob is None:
        raise NotFoundError(rid)
    return archive.unpack(blob)


async def render(
    rid: str, entries: list[tuple[EventId, Event]], *, speed: float | None, fmt: str = "sse"
) -> AsyncIterator[bytes]:
    """``speed``: 1 = original timing, 10 = ten times faster, None = no waiting."""
    created = entries[0][1]
    assert isinstance(created, Created)
    renderer = ChunkRenderer(rid, created)
    previous_ms = entries[0][0].ms
    for eid, event in entries:
        if speed:
            await asyncio.sleep(max(0, eid.ms - previous_ms) / 1000 / speed)
        previous_ms = eid.ms
        if fmt == "sse":
            out = b"".join(sse_event_frames(renderer, eid, event, None))
        elif fmt == "text":
            out = event.text.encode() if isinstance(event, Delta) else b""
        else:
            out = (json.dumps(_as_json(eid, event), ensure_ascii=False) + "\n").encode()
        if out:
            yield out


def _as_json(eid: EventId, event: Event) -> dict[str, Any]:
    import msgspec

    fields = msgspec.structs.asdict(event)
    return {"id": str(eid), "t_ms": eid.ms, "type": type(event).__name__.lower(), **fields}
