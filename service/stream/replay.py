"""Replay a request's answer exactly as clients received it, for audit.

The entries come from the hot log, or the Postgres archive once the hot log is gone
(the caller reads them); the bytes are rendered by the same code as the live stream,
and the original timing comes from the event ids (milliseconds since the epoch).

A replay holds a connection for as long as it waits, so the wait is bounded: the
slowest speed is ``MIN_SPEED`` (half the original pace), and no pause between two
events waits more than ``MAX_GAP_S`` (a request parked for an hour replays its pause in
seconds) -- the connection is never silent longer than that, under any proxy's timeout.
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

MIN_SPEED = 0.5  # the slowest replay: twice the original time
MAX_GAP_S = 5.0  # the longest wait between two events, whatever the original pause


async def render(
    rid: str,
    entries: list[tuple[EventId, Event]],
    *,
    speed: float | None,
    fmt: str = "sse",
    reconnect_hint_ms: int | None = None,
    max_gap_s: float = MAX_GAP_S,
) -> AsyncIterator[bytes]:
    """``speed``: 1 = original timing, 10 = ten times faster, None = no waiting (at
    least ``MIN_SPEED``; each wait at most ``max_gap_s``).
    ``reconnect_hint_ms``: the ``retry:`` line a live stream starts with (SSE only)."""
    created = entries[0][1]
    assert isinstance(created, Created)
    renderer = ChunkRenderer(rid, created)
    if fmt == "sse" and reconnect_hint_ms is not None:
        yield retry_line(reconnect_hint_ms)
    previous_ms = entries[0][0].ms
    for eid, event in entries:
        if speed:
            await asyncio.sleep(min(max_gap_s, max(0, eid.ms - previous_ms) / 1000 / speed))
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
    fields = {k: _readable(v) for k, v in msgspec.structs.asdict(event).items()}
    return {"id": str(eid), "t_ms": eid.ms, "type": type(event).__name__.lower(), **fields}


def _readable(value: Any) -> Any:
    """A field as JSON can hold it: the JSON that ``Created`` keeps as bytes (the input,
    a response's parameters) as what it says -- ``json.dumps`` refused bytes: the replay
    of every Responses request or kept input broke off after its 200, before a line."""
    if not isinstance(value, bytes):
        return value
    try:
        return msgspec.json.decode(value)
    except msgspec.DecodeError:
        return value.decode("utf-8", "replace")
