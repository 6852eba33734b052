"""The event loop every lastevent process runs on (``LASTEVENT_EVENT_LOOP``)."""

from __future__ import annotations

import asyncio
import gc
import io
import logging
import signal
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

from service.settings import EventLoop

T = TypeVar("T")
log = logging.getLogger("lastevent.tasks")


def run(main: Coroutine[Any, Any, T], event_loop: EventLoop) -> T:
    """``asyncio.run`` on uvloop (libuv's loop, in C: less CPU per socket read and timer
    than asyncio's own) or on asyncio's loop."""
    if event_loop is EventLoop.UVLOOP:
        import uvloop

        return uvloop.run(main)
    return asyncio.run(main)


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


async def teardown(
    steps: list[tuple[str, Callable[[], Awaitable[object]]]], limit_s: float
) -> None:
    """Run the shutdown ``steps`` (name, call) in order, within ``limit_s`` in all: uvicorn
    waits for an app's shutdown without a limit, so a step that hangs (a store that stopped
    answering) would keep the process from exiting. The step that ran out is logged, with
    where every task waits."""
    pending = list(steps)
    try:
        async with asyncio.timeout(limit_s):
            while pending:
                await pending[0][1]()
                pending.pop(0)
    except TimeoutError:
        log.warning("shutdown: %s did not finish within %g s", pending[0][0], limit_s)
        dump_tasks()


def freeze_heap() -> None:
    """Once a process has started (its models, tokenizers, engine and clients loaded):
    collect, then move every object left to the permanent generation, so that the
    collector's full passes no longer walk the startup heap -- a pause every reader of
    the process waits out (vLLM's API server does the same at its start)."""
    gc.collect()
    gc.freeze()
