"""A node's readers fed from its worker's appends (``store/local.py``), against a real
Redis: the batcher publishes what each flush wrote, the tailer's readers of a request
the worker owns take it from there after one read back from their cursor, and go back to
the log in Redis whenever the worker lets go.

What is checked: readers that subscribe at any moment, from any cursor, while appends
are in flight and the ownership comes and goes (seeded random interleavings) each get
exactly the log's entries after their cursor, in order, once; a node's own readers
cost no tail read at all; a reader that arrives before the claim moves to memory at the
claim; a reader whose worker lets go mid-answer gets the rest of what another writer
appends, from Redis.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from service.store import replies
from service.store.batcher import AppendBatcher
from service.store.keys import Keys
from service.store.local import LocalFeed
from service.store.log import Owner, RedisLog
from service.store.mailbox import Batch, Subscription
from service.store.tail import LogTailer
from service.stream import events as ev
from service.stream.ids import EventId
from tests.integration.conftest import finished, tailer_on
from tests.integration.test_redis_log import END, delta, new_request

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
async def feed() -> LocalFeed:
    return LocalFeed()


@pytest.fixture
async def node_batcher(rlog: RedisLog, feed: LocalFeed) -> AsyncIterator[AppendBatcher]:
    b = AppendBatcher(rlog, feed=feed)
    b.start()
    yield b
    await b.close()


@pytest.fixture
async def node_tailer(
    tail_client: tuple[Redis, str], keys: Keys, feed: LocalFeed
) -> AsyncIterator[LogTailer]:
    t = tailer_on(tail_client[0], keys, feed=feed)
    await t.start()
    yield t
    await t.stop()


async def until_end(sub: Subscription, timeout_s: float = 20.0) -> Batch:
    got: Batch = []

    async def run() -> None:
        async for batch in sub.batches():
            got.extend(batch)
            if isinstance(got[-1][1], ev.End):
                return

    try:
        await asyncio.wait_for(run(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"no end after {len(got)} entries") from None
    return got


async def logged(redis: Redis, keys: Keys, rid: str) -> Batch:
    entries = await redis.xrange(keys.log(rid))
    return [
        (EventId.from_redis(eid), ev.decode(replies.event_payload(fields)))
        for eid, fields in entries
    ]


@pytest.mark.parametrize("seed", range(40))
async def test_every_reader_gets_the_log_after_its_cursor_once_in_order(
    seed: int,
    rlog: RedisLog,
    redis: Redis,
    keys: Keys,
    feed: LocalFeed,
    node_batcher: AppendBatcher,
    node_tailer: LogTailer,
) -> None:
    rng = random.Random(seed)
    rid, owner = await new_request(rlog)
    readers: list[tuple[EventId | None, Subscription]] = []
    in_flight: list[asyncio.Task[list[EventId]]] = []
    appended = 0
    for _ in range(40):
        step = rng.random()
        if step < 0.35:  # a flush, awaited or left in flight
            events = [delta(appended + i) for i in range(rng.randint(1, 3))]
            appended += len(events)
            task = asyncio.ensure_future(node_batcher.append(owner, events))
            if rng.random() < 0.5:
                await task
            else:
                in_flight.append(task)
        elif step < 0.6:  # a reader, from the start or from a cursor logged so far
            so_far = await logged(redis, keys, rid)
            after = rng.choice([None, *(eid for eid, _ in so_far)])
            readers.append((after, node_tailer.subscribe(rid, after)))
        elif step < 0.75:
            (feed.release if feed.owns(rid) else feed.own)(rid)
        elif step < 0.85:  # let go and taken again at once: read backs overlap
            feed.release(rid)
            feed.own(rid)
        else:
            await asyncio.sleep(rng.choice([0, 0, 0.001, 0.01]))
        await _settle(in_flight, owner, rng)
    await asyncio.gather(*in_flight)
    await node_batcher.end(owner, finished(owner, END))
    readers.append((None, node_tailer.subscribe(rid)))
    log_ = await logged(redis, keys, rid)
    for after, sub in readers:
        got = await until_end(sub)
        want = [(eid, e) for eid, e in log_ if after is None or eid > after]
        assert got == want, f"seed {seed}: a reader from {after} got {len(got)} of {len(want)}"
        sub.close()


async def _settle(
    in_flight: list[asyncio.Task[list[EventId]]], owner: Owner, rng: random.Random
) -> None:
    """Now and then, wait for the flushes in flight (an owner's position must be known
    before its next append is sent)."""
    if in_flight and rng.random() < 0.5:
        await asyncio.gather(*in_flight)
        in_flight.clear()


async def test_a_node_s_own_readers_cost_no_tail_read(
    rlog: RedisLog,
    feed: LocalFeed,
    node_batcher: AppendBatcher,
    node_tailer: LogTailer,
) -> None:
    """Owned before its readers come: no shard is made, no XREAD of the tail is sent;
    every entry after the first read back reaches them from memory."""
    rid, owner = await new_request(rlog)
    feed.own(rid)
    subs = [node_tailer.subscribe(rid) for _ in range(3)]
    for i in range(20):
        await node_batcher.append(owner, [delta(i)])
    await node_batcher.end(owner, finished(owner, END))
    for sub in subs:
        got = await until_end(sub)
        assert [e for _, e in got][1:-1] == [delta(i) for i in range(20)]
    assert node_tailer.shards == 0 and node_tailer.reads == 0
    assert feed.delivered >= 3 * 21


async def test_a_reader_before_the_claim_moves_to_memory_and_back_when_let_go(
    rlog: RedisLog,
    redis: Redis,
    keys: Keys,
    feed: LocalFeed,
    node_batcher: AppendBatcher,
    node_tailer: LogTailer,
) -> None:
    """A reader that came while the request was queued follows Redis; the node's worker
    claims it (``own``): the reader is fed from memory; the worker lets go (a hand-over,
    a fence): another writer's entries reach it from Redis. Each entry once, in order."""
    rid, owner = await new_request(rlog)
    sub = node_tailer.subscribe(rid)
    await node_batcher.append(owner, [delta(0)])
    feed.own(rid)
    await node_batcher.append(owner, [delta(1), delta(2)])
    fed = feed.delivered
    assert fed >= 2
    feed.release(rid)
    other = AppendBatcher(rlog)  # another worker's writes: no feed of this node's
    other.start()
    try:
        await other.append(owner, [delta(3)])
        await other.end(owner, finished(owner, END))
    finally:
        await other.close()
    got = await until_end(sub)
    assert got == await logged(redis, keys, rid)
    assert feed.delivered == fed  # what came after the release came from Redis
    sub.close()
