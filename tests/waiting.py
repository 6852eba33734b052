"""Waiting for a condition instead of sleeping for a while.

A test that sleeps "long enough" for something to happen is slow where the machine is
fast and wrong where it is slow. These poll the condition itself; the timeout is only a
safety net (generous: a slow, shared machine must never trip it) that fails with what
was awaited.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 30.0


async def eventually(
    predicate: Callable[[], T | Awaitable[T]],
    what: str = "the condition",
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    interval: float = 0.01,
) -> T:
    """Poll ``predicate`` (plain or async) until it returns something truthy; return that."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout:g} s")
        await asyncio.sleep(interval)


def wait_until(
    predicate: Callable[[], T],
    what: str = "the condition",
    *,
    timeout: float = DEFAULT_TIMEOUT_S,
    interval: float = 0.05,
) -> T:
    """``eventually`` for synchronous tests."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"gave up waiting for {what} after {timeout:g} s")
        time.sleep(interval)
