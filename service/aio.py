"""The event loop every lastevent process runs on (``LASTEVENT_EVENT_LOOP``)."""

from __future__ import annotations

import asyncio
import io
import logging
import signal
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
log = logging.getLogger("lastevent.tasks")


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


def where(task: asyncio.Task[Any]) -> str:
    """Where ``task`` waits: every frame of its await chain, outermost first (a task's own
    ``print_stack`` shows the outermost coroutine only)."""
    lines = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is not None:
            code = frame.f_code
            lines.append(f"  {code.co_filename}:{frame.f_lineno} in {code.co_name}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return "\n".join(lines) or "  (no frame)"


def dump_tasks() -> None:
    """Log where every asyncio task of this process is waiting (a hung process: SIGUSR1)."""
    out = io.StringIO()
    for task in asyncio.all_tasks():
        out.write(f"--- {task.get_name()}\n{where(task)}\n")
    log.warning("asyncio tasks:\n%s", out.getvalue())


def dump_tasks_on_sigusr1() -> None:
    """``kill -USR1 PID`` logs where the running loop's tasks wait."""
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump_tasks)
