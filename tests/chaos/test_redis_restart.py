"""Redis killed (``kill -9``) and started again on its AOF: the store layer rides through."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from service.store.batcher import AppendBatcher
from service.store.keys import Keys
from service.store.log import RedisLog
from service.store.pool import connect
from service.stream import events as ev
from tests.chaos.conftest import ChaosRedis

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]


def delta(i: int) -> ev.Delta:
    return ev.Delta(text=f"t{i}", token_ids=[i], n=i)


async def test_an_append_waits_out_a_restart_and_is_written_once(tmp_path: Path) -> None:
    """The batcher keeps sending a flush while Redis is down (until its give-up time);
    once Redis is back on its AOF the append lands exactly once, and appends go on."""
    server = ChaosRedis(tmp_path / "redis", appendfsync="always")  # nothing may be lost
    server.start()
    redis = connect(server.url, max_connections=4)
    log = RedisLog(redis, Keys(f"c{uuid.uuid4().hex[:8]}"))
    batcher = AppendBatcher(log, max_backoff_s=0.2)
    batcher.start()
    try:
        rid = uuid.uuid4().hex
        await log.create(rid, ev.Created(kind="chat", model="m", created=0, prompt_tokens=1), 600)
        owner = await log.claim(rid, "w1")
        assert owner is not None
        await batcher.append(owner, [delta(1)])
        server.kill()
        pending = asyncio.ensure_future(
            batcher.append(owner, [delta(2), delta(3)], give_up_at=time.time() + 60)
        )
        async with asyncio.timeout(30):  # it is retried while Redis is down...
            while batcher.retries < 2:
                await asyncio.sleep(0.05)
        assert not pending.done()
        server.start()  # ...and lands once Redis is back
        async with asyncio.timeout(30):
            ids = await pending
        assert len(ids) == 2
        await batcher.append(owner, [delta(4)])
        events = [e for _, e in await log.read(rid)]
        assert events[1:] == [delta(1), delta(2), delta(3), delta(4)]
        assert owner.events == 5
    finally:
        await batcher.close()
        await redis.aclose()
        server.stop()


async def test_an_append_that_gives_up_says_so(chaos_redis: ChaosRedis) -> None:
    redis = connect(chaos_redis.url, max_connections=4)
    log = RedisLog(redis, Keys(f"c{uuid.uuid4().hex[:8]}"))
    batcher = AppendBatcher(log, max_backoff_s=0.1)
    batcher.start()
    try:
        rid = uuid.uuid4().hex
        await log.create(rid, ev.Created(kind="chat", model="m", created=0, prompt_tokens=1), 600)
        owner = await log.claim(rid, "w1")
        assert owner is not None
        chaos_redis.kill()
        with pytest.raises(RedisConnectionError):
            async with asyncio.timeout(30):
                await batcher.append(owner, [delta(1)], give_up_at=time.time() + 0.5)
        assert owner.events == 1  # nothing counted as written
    finally:
        await batcher.close()
        await redis.aclose()
