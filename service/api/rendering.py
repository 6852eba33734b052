"""Chat templates and tokenizers, off the event loop: a conversation of thousands of
messages, or a prompt of megabytes, takes the tokenizer a second, during which a process
that ran it on its loop would answer nobody (not its probes, not its streams).

A small prompt is rendered in place (a hop to a thread costs more than rendering it);
a larger one on one of a fixed few threads, so a flood of large bodies queues for them
rather than starting threads without bound. ``lastevent_prompts_rendering`` counts
those waiting or running.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable, Sequence
from typing import TypeVar

from service.api.metrics import RENDERING
from service.api.schemas import ChatMessage

T = TypeVar("T")

THREADS = 2  # renders at once in an API process (each holds the GIL while in Python)
INLINE_WEIGHT = 8192  # characters (about): rendered on the event loop up to this many
_PER_MESSAGE = 64  # the template's own text around each message, about


def weight(messages: Sequence[ChatMessage], *texts: str | None) -> int:
    """About how many characters a render produces (without running it)."""
    total = len(messages) * _PER_MESSAGE + sum(len(t) for t in texts if t)
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content:
            total += sum(len(getattr(p, "text", "")) + _PER_MESSAGE for p in m.content)
        for call in m.tool_calls or ():
            total += len(call.function.arguments) + _PER_MESSAGE
    return total


class Renderer:
    """Runs renders (template and tokenizer) off the event loop, ``threads`` at a time."""

    def __init__(self, threads: int = THREADS, inline_weight: int = INLINE_WEIGHT) -> None:
        self.threads = threads
        self.inline_weight = inline_weight
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    async def run(self, weight: int, render: Callable[[], T]) -> T:
        """``render()``'s result; in place when ``weight`` (``rendering.weight``) is small."""
        if weight <= self.inline_weight:
            return render()
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                max_workers=self.threads, thread_name_prefix="render"
            )
        RENDERING.inc()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, render)
        finally:
            RENDERING.dec()
