"""The event loop every lastevent process runs on (``LASTEVENT_EVENT_LOOP``)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(main: Coroutine[Any, Any, T], event_loop: str) -> T:
    """``asyncio.run`` on uvloop (libuv's loop, in C: less CPU per socket read and timer
    than asyncio's own) or on asyncio's loop."""
    if event_loop == "uvloop":
        import uvloop

        return uvloop.run(main)
    if event_loop == "asyncio":
        return asyncio.run(main)
    main.close()
    raise ValueError(f"LASTEVENT_EVENT_LOOP={event_loop!r}: uvloop or asyncio")
