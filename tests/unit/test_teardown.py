"""``aio.teardown``: an API's shutdown steps run in order within a limit; one that hangs
is named in the log and the process goes on to exit (uvicorn waits for a shutdown
without a limit)."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import pytest

from service import aio


async def test_steps_run_in_order() -> None:
    ran: list[str] = []

    def step(name: str) -> Callable[[], Awaitable[None]]:
        async def run() -> None:
            await asyncio.sleep(0)
            ran.append(name)

        return run

    await aio.teardown([(n, step(n)) for n in ("a", "b", "c")], 5.0)
    assert ran == ["a", "b", "c"]


async def test_a_hung_step_is_named_and_the_rest_is_skipped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ran: list[str] = []
    hang = asyncio.Event()

    async def fine() -> None:
        ran.append("fine")

    async def after() -> None:
        ran.append("after")

    with caplog.at_level(logging.WARNING, logger="lastevent.tasks"):
        await aio.teardown([("fine", fine), ("the stuck store", hang.wait), ("after", after)], 0.2)
    assert ran == ["fine"]
    assert "shutdown: the stuck store did not finish within 0.2 s" in caplog.text
    assert "asyncio tasks:" in caplog.text  # where everything waited
