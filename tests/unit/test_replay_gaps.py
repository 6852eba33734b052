"""A replay's waits are bounded: a long pause in the original (a parked hour) is not
waited for, so a replay never holds a silent connection longer than the bound."""

from __future__ import annotations

import asyncio

from service.stream import replay
from service.stream.events import Created, Delta, Event
from service.stream.ids import EventId


def entries(gap_ms: int) -> list[tuple[EventId, Event]]:
    t0 = 1_700_000_000_000
    created = Created(kind="chat", model="m", created=t0 // 1000, prompt_tokens=1)
    return [
        (EventId(t0, 0), created),
        (EventId(t0 + 10, 0), Delta(text="before", token_ids=[1], n=1)),
        (EventId(t0 + 10 + gap_ms, 0), Delta(text=" after an hour", token_ids=[2], n=2)),
    ]


async def test_an_hour_long_pause_replays_within_the_gap_bound() -> None:
    async def run() -> bytes:
        out = b""
        async for chunk in replay.render(
            "r1", entries(3_600_000), speed=replay.MIN_SPEED, fmt="text", max_gap_s=0.05
        ):
            out += chunk
        return out

    # (the bound is the safety net: unbounded, this waits two hours)
    assert await asyncio.wait_for(run(), timeout=60) == b"before after an hour"
