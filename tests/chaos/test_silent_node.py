"""A Redis that answers nothing -- frozen (``SIGSTOP``) or cut off by a partition: its
sockets stay open, no RST, no reply -- is given up after a bounded time, never waited on
for ever: a command raises the store's timeout, the worker's named connection and its
control channel are pinged and made again (``service/store/pool.py``, ``liveness.py``,
``owner.py``). A Redis of the test's own, frozen for real."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from service.store.keys import Keys
from service.store.liveness import Announcer
from service.store.owner import OwnerChannel
from service.store.pool import STORE_ERRORS, connect
from tests.servers import OwnRedis
from tests.waiting import eventually

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(60)]

SILENT_S = 0.5
SAFETY_S = 20.0  # a wait this long means it hung: the finding


@pytest.fixture
def server(tmp_path: Path) -> Iterator[OwnRedis]:
    own = OwnRedis(tmp_path / "redis", appendfsync=None)
    own.start()
    try:
        yield own
    finally:
        own.resume()
        own.stop()


def client(server: OwnRedis) -> Redis:
    return connect(server.url, 8, silent_s=SILENT_S, longest_wait_s=0.1)


async def test_a_command_to_a_frozen_redis_is_given_up(server: OwnRedis) -> None:
    redis = client(server)
    try:
        assert await redis.ping()
        server.pause()
        with pytest.raises(STORE_ERRORS):  # (not the safety net's TimeoutError: a hang)
            await asyncio.wait_for(redis.set("k", "v"), SAFETY_S)
        server.resume()
        assert await redis.set("k", "v")  # a new connection: it answers again
    finally:
        server.resume()
        await redis.aclose()


async def test_the_worker_connections_give_up_a_frozen_redis_and_come_back(
    server: OwnRedis, caplog: pytest.LogCaptureFixture
) -> None:
    """The named connection is made again (and the worker announced again) after the
    node was silent; the control channel subscribes again and still delivers."""
    redis = client(server)
    keys = Keys(f"t{uuid.uuid4().hex[:8]}")
    worker = f"w-{uuid.uuid4().hex[:6]}"
    announced = 0

    async def announce() -> None:
        nonlocal announced
        announced += 1

    announcer = Announcer(redis, keys, worker, announce, silent_s=SILENT_S)
    got: list[tuple[str, str]] = []

    async def listen() -> None:
        async for message in OwnerChannel(redis, keys).messages(worker, silent_s=SILENT_S):
            got.append(message)

    caplog.set_level(logging.WARNING)
    tasks = [asyncio.create_task(announcer.run()), asyncio.create_task(listen())]
    try:
        await asyncio.wait_for(announcer.connected.wait(), SAFETY_S)
        server.pause()
        # Both give the silent node up while it stays silent: resumed as soon as the
        # named connection had, the control channel's pings could be answered in time
        # (each hears its own silence, 0.5-0.75 s after the pause: a race on a busy CI).
        await eventually(
            lambda: "answered nothing" in caplog.text and not announcer.connected.is_set(),
            "the silent node given up",
            timeout=SAFETY_S,
        )
        await eventually(
            lambda: "the control channel (subscribing again)" in caplog.text,
            "the control channel given up",
            timeout=SAFETY_S,
        )
        server.resume()
        await eventually(lambda: announced >= 2, "announced again", timeout=SAFETY_S)

        async def delivered() -> bool:
            await redis.publish(keys.control(worker), "cancel:r1")
            return ("cancel", "r1") in got

        await eventually(delivered, "a cancel delivered after", timeout=SAFETY_S)
    finally:
        server.resume()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await redis.aclose()
