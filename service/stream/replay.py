"""Replay a request's answer exactly as clients received it, for audit.

The entries come from the hot log, or the Postgres archive once the hot log is gone
(the caller reads them); the bytes are rendered by the same code as the live stream,
and the original timing comes from the event ids (milliseconds since the epoch).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from service.stream.events import Created, Delta, Event
from service.stream.ids import EventId
from service.stream.render import ChunkRenderer, sse_event_frames
from service.stream.sse import retry_line


async def render(
    rid: str,
    entries: list[tuple[EventId, Event]],
    *,
    speed: float | None,
    fmt: str = "sse",
    reconnect_hint_ms: int | None = None,
) -> AsyncIterator[bytes]:
    """``speed``: 1 = original timing, 10 = ten times faster, None = no waiting.
    ``reconnect_hint_ms``: the ``retry:`` line a live stream starts with (SSE only)."""
    created = entries[0][1]
    assert isinstance(created, Created)
    renderer = ChunkRenderer(rid, created)
    if fmt == "sse" and reconnect_hint_ms is not None:
        yield retry_line(reconnect_hint_ms)
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
    fields = msgspec.structs.asdict(event)
    return {"id": str(eid), "t_ms": eid.ms, "type": type(event).__name__.lower(), **fields}
