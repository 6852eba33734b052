"""The tail reads only the logs that changed: appends notify the shards that follow a log
(its ``tails`` set names their wake streams), against a real Redis.

What is checked: a read after an append names the changed logs only; one append call
that changes many logs adds one wake entry naming them all (an older API process's wake
stream, one entry per log, as it reads them) and every reader gets its events; a
notification that
is lost (Redis lost the registration) is made up for by the shard's sweep; a wake stream
that is gone is forgotten by the append, not made again without a TTL; a log read after
its end registers nothing; a registration lives as long as its request and goes with its
end.
"""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import Redis

from service.store import replies, tail
from service.store.batcher import AppendBatcher
from service.store.keys import LOG_FIELD, WAKE_BATCHED, Keys
from service.store.log import Append, RedisLog
from service.store.tail import LogTailer
from tests.integration.conftest import finished, tailer_on
from tests.integration.test_redis_log import (
    END,
    collect,
    created,
    delta,
    new_request,
    until_blocked,
)
from tests.waiting import eventually

pytestmark = pytest.mark.timeout(30)


class Reads:
    """The stream names of every XREAD the tailer's client sends (to real Redis)."""

    def __init__(self, client: Redis) -> None:
        self.names: list[set[str]] = []
        send = client.xread

        async def xread(streams: Any, *args: Any, **kw: Any) -> Any:
            self.names.append({k.decode() if isinstance(k, bytes) else k for k in streams})
            return await send(streams, *args, **kw)

        client.xread = xread  # type: ignore[method-assign]


async def test_a_read_names_only_the_logs_that_changed(
    rlog: RedisLog,
    redis: Redis,
    keys: Keys,
    batcher: AppendBatcher,
    tail_client: tuple[Redis, str],
    tailer: LogTailer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tail, "SWEEP_S", 3600.0)  # no sweep: notifications only
    reads = Reads(tailer._reader)
    requests = [await new_request(rlog) for _ in range(30)]
    subs = [tailer.subscribe(r) for r, _ in requests]
    firsts = [await collect(s, 1) for s in subs]
    assert all(f[0][1] == created() for f in firsts)
    await until_blocked(tailer, redis, tail_client[1])
    before = len(reads.names)
    changed = [requests[3], requests[17]]
    for _, owner in changed:
        await batcher.append(owner, [delta(1), delta(2)])
    changed_ids = {r for r, _ in changed}
    for (r, _), sub in zip(requests, subs, strict=True):
        if r in changed_ids:
            assert [e for _, e in await collect(sub, 2)] == [delta(1), delta(2)]
    after = reads.names[before:]
    wake = tailer._shards[0]._wake_key
    logs = {keys.log(r) for r, _ in changed}
    # blocked reads of the wake stream alone, and reads of the changed logs only
    assert after and all(names == {wake} or names <= logs for names in after), after
    assert set().union(*after) - {wake} == logs
    assert all(s.queue.empty() for s in subs)


async def test_one_call_wakes_each_shard_once_naming_every_log(
    rlog: RedisLog, redis: Redis, keys: Keys
) -> None:
    """A worker's flush (one script call for many requests) adds one entry to each wake
    stream, naming every log it changed; a wake stream named the older way (an API
    process of the previous version, during a rolling upgrade) gets one entry per log, the
    only form its shard reads."""
    requests = [await new_request(rlog) for _ in range(6)]
    part = keys.partition(requests[0][0])
    batched = keys.wake(part, "new")
    older = keys.wake(part, "old").removesuffix(WAKE_BATCHED)
    for wake in (batched, older):
        await redis.xadd(wake, {"w": "1"})
    for r, _ in requests:
        await redis.sadd(keys.tails(r), batched, older)
    items = [Append(r, o.epoch, [delta(1)], expect=o.events) for r, o in requests]
    assert all(isinstance(x, list) for x in await rlog.append_many(items))
    logs = [keys.log(r).encode() for r, _ in requests]
    as_sent = Redis(connection_pool=redis.connection_pool)  # (fields as a list, repeats kept)
    as_sent.set_response_callback("XRANGE", replies.raw)
    raw = await as_sent.xrange(batched)
    assert [fields for _, fields in raw[1:]] == [
        [x for log_key in logs for x in (LOG_FIELD, log_key)]
    ]
    assert [f[LOG_FIELD] for _, f in (await redis.xrange(older))[1:]] == logs


async def test_readers_of_many_logs_changed_in_one_call_get_their_events(
    rlog: RedisLog,
    redis: Redis,
    tail_client: tuple[Redis, str],
    tailer: LogTailer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(tail, "SWEEP_S", 3600.0)  # no sweep: notifications only
    requests = [await new_request(rlog) for _ in range(40)]
    subs = [tailer.subscribe(r) for r, _ in requests]
    assert [len(await collect(s, 1)) for s in subs] == [1] * len(subs)
    await until_blocked(tailer, redis, tail_client[1])
    for step in (1, 2):
        items = [Append(r, o.epoch, [delta(step)], expect=o.events) for r, o in requests]
        await rlog.append_many(items)
        for _, o in requests:
            o.events += 1
        for sub in subs:
            assert [e for _, e in await collect(sub, 1)] == [delta(step)]


async def test_a_lost_registration_is_made_up_by_the_sweep(
    rlog: RedisLog,
    redis: Redis,
    keys: Keys,
    batcher: AppendBatcher,
    tail_client: tuple[Redis, str],
    tailer: LogTailer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redis lost the shard's registration (a restart, a failover): the append notifies
    nobody, and the reader still gets it, from the sweep that reads every followed log."""
    monkeypatch.setattr(tail, "SWEEP_S", 0.5)
    request_id, owner = await new_request(rlog)
    sub = tailer.subscribe(request_id)
    assert len(await collect(sub, 1)) == 1
    await until_blocked(tailer, redis, tail_client[1])
    assert await redis.delete(keys.tails(request_id)) == 1
    await batcher.append(owner, [delta(1)])
    assert [e for _, e in await collect(sub, 1)] == [delta(1)]


async def test_a_gone_wake_stream_is_forgotten(
    rlog: RedisLog, redis: Redis, keys: Keys, batcher: AppendBatcher
) -> None:
    """A shard whose API process died left its wake stream in the log's tails set: once
    the stream is gone (its TTL), an append drops it from the set instead of making the
    stream again (it would have no TTL)."""
    request_id, owner = await new_request(rlog)
    dead = keys.wake(0, "dead-process")
    await redis.sadd(keys.tails(request_id), dead)
    await batcher.append(owner, [delta(1)])
    assert not await redis.exists(dead)
    assert not await redis.sismember(keys.tails(request_id), dead)


async def test_registration_lives_with_the_request_and_goes_with_its_end(
    rlog: RedisLog,
    redis: Redis,
    keys: Keys,
    batcher: AppendBatcher,
    tailer: LogTailer,
) -> None:
    request_id, owner = await new_request(rlog)
    sub = tailer.subscribe(request_id)
    assert len(await collect(sub, 1)) == 1
    wake = tailer._shards[0]._wake_key
    tails = keys.tails(request_id)
    assert await redis.smembers(tails) == {wake.encode()}
    assert 0 < await redis.ttl(tails) <= await redis.ttl(keys.meta(request_id))
    await batcher.end(owner, finished(owner, END))
    assert [e for _, e in await collect(sub, 1)] == [END]
    assert not await redis.exists(tails)
    sub.close()
    # an ended log read again (a replay) is read once, and registers nothing
    again = tailer.subscribe(request_id)
    got = await collect(again, 2)
    assert [e for _, e in got] == [created(), END]
    assert not await redis.exists(tails)
    again.close()
    await tailer.stop()
    assert not await redis.exists(wake)  # a stopping shard removes its wake stream


async def test_a_departed_reader_leaves_the_tails_set(
    rlog: RedisLog, redis: Redis, keys: Keys, tailer: LogTailer
) -> None:
    request_id, _ = await new_request(rlog)
    sub = tailer.subscribe(request_id)
    assert len(await collect(sub, 1)) == 1
    tails = keys.tails(request_id)
    assert await redis.scard(tails) == 1
    sub.close()  # the client went away mid-answer

    async def left() -> bool:
        return await redis.scard(tails) == 0

    await eventually(left, "the shard to leave the tails set", timeout=5)


async def test_a_shard_survives_an_error_that_is_not_a_store_error(
    rlog: RedisLog, batcher: AppendBatcher, tail_client: tuple[Redis, str], keys: Keys
) -> None:
    """Whatever a read raises (here a RuntimeError, as a Redis client not mapping one of
    its errors would), the shard logs it and goes on: its readers are not left with
    pings for ever (a cluster failover killed a shard's loop so, before)."""
    tailer = tailer_on(tail_client[0], keys)
    reader = tailer._reader  # (the client its shards read with)
    send = reader.xread
    broken = {"left": 2}

    async def xread(streams: Any, *args: Any, **kw: Any) -> Any:
        if broken["left"]:
            broken["left"] -= 1
            raise RuntimeError("a client error nobody mapped")
        return await send(streams, *args, **kw)

    reader.xread = xread  # type: ignore[method-assign]
    await tailer.start()
    try:
        request_id, owner = await new_request(rlog)
        sub = tailer.subscribe(request_id)
        await batcher.append(owner, [delta(1)])
        got = await collect(sub, 2)
        assert [e for _, e in got] == [created(), delta(1)] and not broken["left"]
    finally:
        await tailer.stop()
