"""A worker's named connection and the observer, against a real Redis: subscribed while
the worker lives, back (and announced again) after a cut, gone when it stops."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from redis.asyncio import Redis

from service.settings import Settings
from service.store.keys import Keys
from service.store.liveness import Announcer, Observer
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(30)


async def test_a_named_connection_is_seen_comes_back_and_goes(redis: Redis, keys: Keys) -> None:
    worker = f"w-{uuid.uuid4().hex[:6]}"
    announced = 0

    async def announce() -> None:
        nonlocal announced
        announced += 1
        await redis.hset(keys.workers, worker, "1 0 0 0")

    announcer = Announcer(redis, keys, worker, announce, silent_s=Settings().redis_silent_s)
    observer = Observer(redis, keys)
    task = asyncio.create_task(announcer.run())
    try:
        await asyncio.wait_for(announcer.connected.wait(), 10)
        known, connected = await observer.poll([worker])
        assert worker in known and connected == {worker} and announced == 1
        # operators see it by name; a cut (CLIENT KILL, a proxy reset) is made good
        [named] = [c for c in await redis.client_list() if c["name"] == announcer.name]
        assert named["cmd"] == "ssubscribe"
        await redis.client_kill_filter(_id=named["id"])
        await eventually(lambda: announced == 2, "announced again after the cut")
        assert (await observer.poll([worker]))[1] == {worker}
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    # its process gone: the node counts no subscriber (other workers are not asked about)
    # once it has read the close (a socket closed here reaches Redis a moment later)
    async def unsubscribed() -> bool:
        return (await observer.poll([worker, "never-seen"]))[1] == set()

    await eventually(unsubscribed, "no subscriber once the connection is closed")
    await observer.close()
