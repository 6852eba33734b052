"""The one-consumer Mailbox readers wait on (pure asyncio, no Redis)."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.store.mailbox import Mailbox
from tests.waiting import eventually


@given(st.lists(st.lists(st.integers(), max_size=3), max_size=20))
def test_fifo_like_a_queue(items: list[list[int]]) -> None:
    async def run() -> list[object]:
        box = Mailbox()
        for item in items:
            box.put_nowait(item)  # type: ignore[arg-type]
        assert box.qsize() == len(items)
        return [await box.get() for _ in items]

    assert asyncio.run(run()) == items


async def test_get_waits_until_a_put_and_unget_goes_first() -> None:
    box = Mailbox()
    getting = asyncio.ensure_future(box.get())
    await eventually(lambda: box._waiter is not None, "the get to wait")
    assert not getting.done()
    box.put_nowait([])
    assert await asyncio.wait_for(getting, 1) == []
    box.put_nowait([1])  # type: ignore[list-item]
    box.unget(ValueError("back"))
    assert isinstance(box.get_nowait(), ValueError)
    assert box.get_nowait() == [1]
    assert box.empty()
    with pytest.raises(asyncio.QueueEmpty):
        box.get_nowait()


async def test_a_cancelled_get_loses_nothing() -> None:
    box = Mailbox()
    getting = asyncio.ensure_future(box.get())
    await eventually(lambda: box._waiter is not None, "the get to wait")
    getting.cancel()
    await asyncio.gather(getting, return_exceptions=True)
    box.put_nowait([7])  # type: ignore[list-item]
    assert await box.get() == [7]
