"""Committed reads (``service/store/commit.py``), against servers of the test's own: a
primary and its replica, frozen for real (SIGSTOP).

What is checked: each level is refused, with what is missing, by servers that cannot give
it, and accepted by ones that can; at ``replica`` nothing is sent to a tail reader, a log
reader or the recorder while no replica acknowledges it -- and all of it once one does; a
barrier confirms every read that finished before it was sent (concurrent reads share a
barrier); at ``disk`` under ``appendfsync always`` no barrier is needed at all.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from service.store.commit import Committer, Durability, Misconfigured, Uncommitted
from service.store.keys import Keys
from service.store.log import RedisLog
from service.store.outbox import Outbox
from tests.integration.conftest import finished, tailer_on
from tests.integration.test_redis_log import END, collect, delta, new_request
from tests.servers import OwnRedis
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(60)

TIMEOUT_MS = 300  # a barrier no replica acknowledges fails this soon


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[tuple[OwnRedis, OwnRedis]]:
    primary = OwnRedis(tmp_path / "primary", appendfsync=None)
    primary.start()
    replica = OwnRedis(tmp_path / "replica", appendfsync=None, replica_of=primary)
    try:
        replica.start()
        yield primary, replica
    finally:
        replica.stop()
        primary.stop()


@pytest.fixture
def keys() -> Keys:
    return Keys(f"c{uuid.uuid4().hex[:8]}")


@pytest.fixture
async def client(pair: tuple[OwnRedis, OwnRedis]) -> AsyncIterator[Redis]:
    r = Redis.from_url(pair[0].url)
    try:
        yield r
    finally:
        await r.aclose()


@pytest.fixture
async def committer(client: Redis, keys: Keys) -> Committer:
    c = Committer(client, keys, Durability.REPLICA, timeout_ms=TIMEOUT_MS)
    assert "replica" in await c.check()
    return c


async def _server(tmp_path: Path, appendfsync: str | None) -> tuple[OwnRedis, Redis]:
    server = OwnRedis(tmp_path / f"r-{appendfsync}", appendfsync=appendfsync)
    server.start()
    return server, Redis.from_url(server.url)


async def test_each_level_is_refused_by_servers_that_cannot_give_it(
    tmp_path: Path, keys: Keys
) -> None:
    for appendfsync, level, missing in [
        (None, Durability.DISK, "appendonly yes"),
        ("everysec", Durability.DISK, "appendfsync always"),
        ("always", Durability.REPLICA, "connected replica"),
    ]:
        server, r = await _server(tmp_path, appendfsync)
        try:
            with pytest.raises(Misconfigured, match=missing):
                await Committer(r, keys, level).check()
            # and a read is never confirmed by a level the servers cannot give
            with pytest.raises(Misconfigured):
                await Committer(r, keys, level).confirm(0)
            assert "memory" in await Committer(r, keys, Durability.MEMORY).check()
        finally:
            await r.aclose()
            server.stop()


async def test_disk_under_appendfsync_always_needs_no_barrier(tmp_path: Path, keys: Keys) -> None:
    server, r = await _server(tmp_path, "always")
    try:
        c = Committer(r, keys, Durability.DISK)
        assert "always" in await c.check()
        await c.confirm(0)
        assert c.barriers == 0  # every answer follows the fsync of what it shows
    finally:
        await r.aclose()
        server.stop()


async def test_a_tail_reader_is_sent_only_what_a_replica_acknowledged(
    pair: tuple[OwnRedis, OwnRedis], client: Redis, keys: Keys, committer: Committer
) -> None:
    _, replica = pair
    rlog = RedisLog(client, keys, committer=committer)
    tailer = tailer_on(client, keys, block_ms=200, committer=committer)
    await tailer.start()
    try:
        rid, owner = await new_request(rlog)
        sub = tailer.subscribe(rid)
        await rlog.append(rid, owner.epoch, [delta(1)], expect=1)
        first = await collect(sub, 2)
        assert [type(e).__name__ for _, e in first] == ["Created", "Delta"]

        replica.pause()
        try:
            await rlog.append(rid, owner.epoch, [delta(2)], expect=2)
            tried = committer.barriers
            # the shard read it and tried to confirm it, twice, in vain: nothing was sent
            await eventually(lambda: committer.barriers >= tried + 2, what="barriers tried")
            assert sub.queue.empty()
            with pytest.raises(Uncommitted):
                await rlog.read(rid)
        finally:
            replica.resume()
        got = await collect(sub, 1)
        assert [e for _, e in got] == [delta(2)]
        assert [e for _, e in await rlog.read(rid)][1:] == [delta(1), delta(2)]
        sub.close()
    finally:
        await tailer.stop()


async def test_the_recorder_reads_an_end_only_once_a_replica_has_it(
    pair: tuple[OwnRedis, OwnRedis], client: Redis, keys: Keys, committer: Committer
) -> None:
    _, replica = pair
    rlog = RedisLog(client, keys, committer=committer)
    outbox = Outbox(client, keys, committer)
    await outbox.ensure_group()
    rid, owner = await new_request(rlog)
    replica.pause()
    try:
        await rlog.end(rid, owner.epoch, finished(owner, delta(1), END))
        with pytest.raises(Uncommitted):
            await outbox.read(0, "r1", 10, pending=False, block_ms=100)
    finally:
        replica.resume()
    # what was read stays pending for this recorder: it reads it again, committed now
    [(_, found)] = await outbox.read(0, "r1", 10, pending=True, block_ms=100)
    assert found is not None and found[0].request_id == rid


async def test_concurrent_reads_share_a_barrier(client: Redis, committer: Committer) -> None:
    await asyncio.gather(*(committer.confirm(0) for _ in range(200)))
    # one barrier for the first read, one for all that came while it was out
    assert committer.barriers <= 2


async def test_a_barrier_covers_only_reads_that_finished_before_it_was_sent(
    pair: tuple[OwnRedis, OwnRedis], committer: Committer
) -> None:
    _, replica = pair
    replica.pause()
    try:
        first = asyncio.ensure_future(committer.confirm(0))
        await eventually(lambda: committer.barriers == 1, what="the first barrier sent")
        second = asyncio.ensure_future(committer.confirm(0))  # read after it was sent
        with pytest.raises(Uncommitted):
            await first
    finally:
        replica.resume()
    await second  # confirmed by a barrier of its own, sent after the first
    assert committer.barriers == 2
