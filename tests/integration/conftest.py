"""Fixtures the integration tests share: a real Redis client whose keys (the test's own
random ``key_prefix``) are deleted after the test, the log and batcher over it, and a
tail client and tailer. A module overrides ``keys`` where it needs partitions."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from service.settings import Settings
from service.store.batcher import AppendBatcher
from service.store.keys import Keys
from service.store.log import Owner, RedisLog
from service.store.tail import LogTailer
from service.stream import events as ev
from service.stream.endings import Ending
from tests.endings import ending

DEFAULTS = Settings()  # the numbers a process takes unless told (LASTEVENT_*)


@pytest.fixture
def keys(key_prefix: str) -> Keys:
    return Keys(key_prefix)


@pytest.fixture
async def redis(redis_url: str, key_prefix: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    stale = [k async for k in client.scan_iter(match=f"{key_prefix}:*", count=1000)]
    if stale:
        await client.delete(*stale)
    await client.aclose()


@pytest.fixture
def rlog(redis: Redis, keys: Keys) -> RedisLog:
    return RedisLog(redis, keys)


@pytest.fixture
async def batcher(rlog: RedisLog) -> AsyncIterator[AppendBatcher]:
    b = AppendBatcher(rlog)
    b.start()
    yield b
    await b.close()


@pytest.fixture
async def tail_client(redis_url: str) -> AsyncIterator[tuple[Redis, str]]:
    """A client for a tailer, named (tests find its blocked reads by the name)."""
    name = f"tail-{uuid.uuid4().hex[:12]}"
    # as service/app.py: the XREAD BLOCK outlives redis-py's default 5 s socket timeout
    client = Redis.from_url(redis_url, client_name=name, socket_timeout=15)
    yield client, name
    await client.aclose()


@pytest.fixture
async def tailer(tail_client: tuple[Redis, str], keys: Keys) -> AsyncIterator[LogTailer]:
    t = tailer_on(tail_client[0], keys)
    await t.start()  # no shard, no read yet: each test's first subscribe starts one
    yield t
    await t.stop()


def tailer_on(client: Redis, keys: Keys, **given: Any) -> LogTailer:
    """A tailer reading with ``client``, with the numbers a process takes (Settings') but
    a 10 s block (a test's reads end by a wake, never by the block's timeout), and a
    test's own numbers or parts in ``given``."""
    numbers = {"count": DEFAULTS.tail_count, "shard_size": DEFAULTS.tail_shard_size}
    return LogTailer(client, keys, **{"block_ms": 10_000, **numbers, **given})


def finished(owner: Owner, *events: ev.Event) -> Ending:
    """A test's ending of ``owner``'s request: ``events``, its ``End`` last."""
    return ending(owner.request_id, *events)
