"""RedisLog, AppendBatcher, LogTailer and RequestQueue against a real Redis: no mocks.

Every test works under its own random key prefix (``key_prefix``), so the file runs in
parallel (xdist) and twice in a row against one shared server. The one server-wide action,
``SCRIPT FLUSH``, is harmless to others: redis-py reloads a missing script (``Script`` retries
on NOSCRIPT; a pipeline checks ``SCRIPT EXISTS`` first) -- unless a flush lands between another
flush's SCRIPT EXISTS and its EVALSHAs, a microsecond window.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid

import pytest
from redis.asyncio import Redis
from redis.asyncio.connection import Connection

from service.settings import Settings
from service.store.batcher import AppendBatcher
from service.store.keys import QUEUE_GROUP, Keys
from service.store.log import (
    AlreadyEnded,
    Append,
    Fenced,
    LogGap,
    LogGone,
    Owner,
    RedisLog,
    RequestExists,
)
from service.store.mailbox import Batch, Subscription
from service.store.queue import Job, RequestQueue, encode_job
from service.store.tail import LogTailer
from service.stream import events as ev
from service.stream.ids import EventId
from service.stream.params import SamplingParams
from tests.integration.conftest import finished, tailer_on
from tests.waiting import eventually

DEFAULTS = Settings()  # the numbers a process takes unless told (LASTEVENT_*)
LEASES = {"lease_ttl_s": DEFAULTS.lease_ttl_s, "refresh_s": DEFAULTS.lease_refresh_s}

pytestmark = pytest.mark.timeout(30)

CREATED_AT = int(time.time())
END = ev.End(state="finished", finish_reason="stop", prompt_tokens=3, completion_tokens=8)


def created() -> ev.Created:
    return ev.Created(kind="chat", model="m", created=CREATED_AT, prompt_tokens=3)


def delta(i: int) -> ev.Delta:
    return ev.Delta(text=f"t{i}", token_ids=[i], n=i)


def rid() -> str:
    return uuid.uuid4().hex


async def new_request(rlog: RedisLog) -> tuple[str, Owner]:
    """A created request claimed by w1: its id and its owner (epoch 1)."""
    request_id = rid()
    await rlog.create(request_id, created(), 600)
    owner = await rlog.claim(request_id, "w1")
    assert owner is not None and owner.epoch == 1 and owner.events == 1
    return request_id, owner


async def collect(sub: Subscription, n: int, timeout: float = 5.0) -> Batch:
    """Batches from ``sub`` until ``n`` events arrived (or, on timeout, what did)."""
    got: Batch = []

    async def run() -> None:
        async for batch in sub.batches():
            got.extend(batch)
            if len(got) >= n:
                return

    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(run(), timeout)
    return got


async def blocked_reads(redis: Redis, client_name: str) -> list[dict[str, str]]:
    """The connections of client ``client_name`` that Redis holds blocked in an XREAD."""
    return [
        c
        for c in await redis.client_list()
        if c["name"] == client_name and c["cmd"] == "xread" and "b" in c["flags"]
    ]


async def until_blocked(tailer: LogTailer, redis: Redis, client_name: str) -> list[dict[str, str]]:
    """Until every shard of ``tailer`` sits in XREAD BLOCK in a read issued after it took in
    every wake sent so far, i.e. a read that names every log subscribed until now and has
    nothing to deliver; returns those blocked connections (one per shard)."""

    async def settled() -> list[dict[str, str]] | None:
        for shard in tailer._shards:
            if shard._wake_pending:
                return None  # a wake is still to go out
            newest = await redis.xrevrange(shard._wake_key, count=1)
            if newest and newest[0][0] != shard._wake_last:
                return None  # a wake is still to come back
        blocked = await blocked_reads(redis, client_name)
        return blocked if len(blocked) == tailer.shards else None

    return await eventually(settled, "the tailer to block in XREAD", timeout=10)


# -- RedisLog ---------------------------------------------------------------------------


async def test_create_writes_created_first_with_ttls(rlog: RedisLog, redis: Redis, keys: Keys):
    request_id, first = rid(), created()
    eid = await rlog.create(request_id, first, 600)
    assert await rlog.read(request_id) == [(eid, first)]
    assert await rlog.first(request_id) == first
    meta = await rlog.meta(request_id)
    assert meta is not None
    assert (meta.state, meta.epoch, meta.owner, meta.last_event_id) == ("queued", 0, None, str(eid))
    for key in (keys.log(request_id), keys.meta(request_id)):
        assert 0 < await redis.ttl(key) <= 600
    # the same call again (a retry after a lost reply) writes nothing and answers the same id
    assert await rlog.create(request_id, created(), 600) == eid
    other = ev.Created(kind="text", model="m", created=CREATED_AT, prompt_tokens=9)
    with pytest.raises(RequestExists):
        await rlog.create(request_id, other, 600)
    assert await redis.xlen(keys.log(request_id)) == 1


async def test_create_writes_lease_and_job_in_the_same_step(
    rlog: RedisLog, redis: Redis, keys: Keys
):
    """The submit path's one round trip: log, first reader's lease and queue entry together."""
    queue = RequestQueue(redis, keys)
    await queue.ensure_group()
    request_id = rid()
    job = Job(
        request_id=request_id,
        prompt_token_ids=[1, 2],
        params=SamplingParams(max_tokens=5),
        deadline_unix_s=0.0,
    )
    expiry = int(time.time() * 1000) + 10_000
    await rlog.create(request_id, created(), 600, lease=("tok", expiry), job=encode_job(job))
    assert await redis.zrange(keys.readers(request_id), 0, -1, withscores=True) == [
        (b"tok", float(expiry))
    ]
    assert 0 < await redis.ttl(keys.readers(request_id)) <= 600
    [(_entry, got)] = await queue.read(0, "c1", count=10, block_ms=100)
    assert got == job
    other = rid()  # without them: the log alone
    await rlog.create(other, created(), 600)
    assert not await redis.exists(keys.readers(other))
    assert await queue.read(0, "c1", count=10, block_ms=100) == []


async def test_fencing_takeover_and_terminal(rlog: RedisLog, redis: Redis, keys: Keys):
    request_id = rid()
    created_id = await rlog.create(request_id, created(), 600)
    assert (await rlog.claim(request_id, "w1")).epoch == 1  # type: ignore[union-attr]
    assert (await rlog.claim(request_id, "w2")).epoch == 2  # type: ignore[union-attr]  # takeover fences w1 out
    meta = await rlog.meta(request_id)
    assert meta is not None and (meta.state, meta.epoch, meta.owner) == ("running", 2, "w2")

    with pytest.raises(Fenced):
        await rlog.append(request_id, 1, [delta(1)])
    assert await redis.xlen(keys.log(request_id)) == 1

    ids = await rlog.append(request_id, 2, [delta(1), delta(2)])
    assert created_id < ids[0] < ids[1]
    end_ids = await rlog.append(request_id, 2, [END], terminal_state="finished", ttl_s=30)
    with pytest.raises(AlreadyEnded):
        await rlog.append(request_id, 2, [delta(3)])
    assert [e for _, e in await rlog.read(request_id)] == [created(), delta(1), delta(2), END]
    assert await rlog.last(request_id) == (end_ids[0], END)
    meta = await rlog.meta(request_id)
    assert meta is not None
    assert (meta.state, meta.epoch, meta.last_event_id) == ("finished", 2, str(end_ids[0]))
    for key in (keys.log(request_id), keys.meta(request_id)):
        assert 0 < await redis.ttl(key) <= 30

    assert await rlog.claim(request_id, "w3") is None  # ended
    assert await rlog.claim("no-such-request", "w3") is None  # unknown
    assert not await redis.exists(keys.meta("no-such-request"))
    assert (await rlog.meta(request_id)).epoch == 2  # type: ignore[union-attr]


# -- AppendBatcher ----------------------------------------------------------------------


async def test_terminal_append_right_sizes_the_log(
    rlog: RedisLog, redis: Redis, keys: Keys, tail_client: tuple[Redis, str]
) -> None:
    """A stream node's listpack is preallocated to 4 KiB and the last one never shrinks:
    a 100-token answer would keep ~47 B per entry for its whole TTL. The terminal append
    copies the log into a fitting allocation: <= 40 B per stored token (issue 7's target),
    same entries, same ids, TTL set, a reader blocked on the key still woken."""
    request_id, epoch = await new_request(rlog)
    for i in range(98):  # one token per step, the shape of a bench answer: 100 entries in all
        await rlog.append(
            request_id, epoch.epoch, [ev.Delta(text=f" w{i}", token_ids=[12345], n=i + 1)]
        )
    before = await redis.memory_usage(keys.log(request_id), samples=0)
    entries_before = await rlog.read(request_id)
    tailer = tailer_on(tail_client[0], keys)
    await tailer.start()
    try:
        sub = tailer.subscribe(request_id, entries_before[-1][0])
        await until_blocked(tailer, redis, tail_client[1])  # blocked on the log now
        await rlog.append(request_id, epoch.epoch, [END], terminal_state="finished", ttl_s=60)
        woken = await collect(sub, 1)
    finally:
        await tailer.stop()
    after = await redis.memory_usage(keys.log(request_id), samples=0)
    entries = await rlog.read(request_id)
    assert entries[:-1] == entries_before and entries[-1][1] == END
    assert [e for _, e in woken] == [END]
    assert after / 98 <= 40 < before / 98
    assert 0 < await redis.ttl(keys.log(request_id)) <= 60
    assert not await redis.exists(keys.scratch(request_id))


async def test_append_many_fences_each_request_on_its_own(rlog: RedisLog):
    """One script call for a whole flush: a fenced or ended request is refused, the
    others in the same call are written."""
    ok, ok_epoch = await new_request(rlog)
    taken, _ = await new_request(rlog)
    assert (await rlog.claim(taken, "w2")).epoch == 2  # type: ignore[union-attr]  # another worker took it over
    done, done_epoch = await new_request(rlog)
    await rlog.append(done, done_epoch.epoch, [END], terminal_state="finished", ttl_s=60)
    results = await rlog.append_many(
        [
            Append(taken, 1, [delta(1)]),
            Append(ok, ok_epoch.epoch, [delta(1), delta(2)]),
            Append(done, done_epoch.epoch, [delta(3)]),
            Append(ok, ok_epoch.epoch, [END], terminal_state="finished", ttl_s=60),
        ]
    )
    assert isinstance(results[0], Fenced) and isinstance(results[2], AlreadyEnded)
    assert len(results[1]) == 2 and len(results[3]) == 1  # type: ignore[arg-type]
    assert [e for _, e in await rlog.read(ok)] == [created(), delta(1), delta(2), END]
    assert [e for _, e in await rlog.read(taken)] == [created()]
    assert [e for _, e in await rlog.read(done)] == [created(), END]


async def test_batcher_one_round_trip_per_step(rlog: RedisLog, batcher: AppendBatcher):
    requests = [await new_request(rlog) for _ in range(20)]
    fenced_id = requests[7][0]
    assert (await rlog.claim(fenced_id, "w2")).epoch == 2  # type: ignore[union-attr]  # epoch 1 is stale now

    seen: dict[str, list[EventId]] = {r: [] for r, _ in requests}
    for step in range(2):
        results = await asyncio.gather(
            *(batcher.append(e, [delta(3 * step + i) for i in range(3)]) for r, e in requests),
            return_exceptions=True,
        )
        assert batcher.round_trips == step + 1
        assert batcher.appends == 20 * (step + 1)
        for (request_id, _), result in zip(requests, results, strict=True):
            if request_id == fenced_id:
                assert isinstance(result, Fenced), result
                continue
            assert isinstance(result, list) and len(result) == 3, result
            seen[request_id].extend(result)

    assert [e for _, e in await rlog.read(fenced_id)] == [created()]
    for request_id, ids in seen.items():
        if request_id == fenced_id:
            continue
        assert ids == sorted(set(ids))  # strictly increasing across both steps
        entries = await rlog.read(request_id)
        assert [i for i, _ in entries[1:]] == ids
        assert [e for _, e in entries[1:]] == [delta(i) for i in range(6)]


class CountingConnection(Connection):
    writes = 0

    async def send_packed_command(self, command, check_health=True):  # type: ignore[no-untyped-def]
        CountingConnection.writes += 1
        await super().send_packed_command(command, check_health)


async def test_batcher_flush_is_one_network_round_trip(redis_url: str, redis: Redis, keys: Keys):
    client = Redis.from_url(redis_url, connection_class=CountingConnection)
    rlog = RedisLog(client, keys)  # its keys are cleaned up by the `redis` fixture
    batcher = AppendBatcher(rlog)
    batcher.start()
    try:
        requests = [await new_request(rlog) for _ in range(5)]
        await asyncio.gather(*(batcher.append(e, [delta(0)]) for r, e in requests))  # warm
        before = CountingConnection.writes
        await asyncio.gather(*(batcher.append(e, [delta(1)]) for r, e in requests))
        assert batcher.round_trips == 2
        assert CountingConnection.writes - before == 1
    finally:
        await batcher.close()
        await client.aclose()


async def test_batcher_survives_script_flush(
    rlog: RedisLog, batcher: AppendBatcher, redis_url: str
):
    request_id, epoch = await new_request(rlog)
    first = await batcher.append(epoch, [delta(1)])
    admin = Redis.from_url(redis_url)
    try:
        await admin.script_flush()
        assert await admin.script_exists(rlog._append.sha) == [False]
        second = await batcher.append(epoch, [delta(2)])
        assert await admin.script_exists(rlog._append.sha) == [True]
    finally:
        await admin.aclose()
    assert first[0] < second[0]
    assert (await rlog.claim(request_id, "w2")).epoch == 2  # type: ignore[union-attr]  # the plain Script path reloads too
    assert [e for _, e in await rlog.read(request_id)] == [created(), delta(1), delta(2)]


# -- LogTailer --------------------------------------------------------------------------


async def test_tailer_multiplexes_many_readers(
    rlog: RedisLog,
    redis: Redis,
    batcher: AppendBatcher,
    tailer: LogTailer,
    tail_client: tuple[Redis, str],
):
    requests = [await new_request(rlog) for _ in range(50)]
    shared, shared_epoch = await new_request(rlog)
    second_id = (await rlog.append(shared, shared_epoch.epoch, [delta(0)]))[0]
    shared_epoch.events += 1  # written around the batcher: where its next append starts

    subs = [(r, tailer.subscribe(r), 10) for r, _ in requests]  # Created + 8 deltas + End
    subs.append((shared, tailer.subscribe(shared), 11))
    subs.append((shared, tailer.subscribe(shared, after=second_id), 9))
    assert tailer.subscriptions == 52
    # liveness, not a benchmark: without the wake these would wait out the 10 s block
    firsts = await asyncio.wait_for(asyncio.gather(*(collect(s, 1) for _, s, _ in subs[:51])), 3)
    assert all(b[0][1] == created() for b in firsts)
    firsts.append([])  # the reader after the 2nd event has nothing yet
    await until_blocked(tailer, redis, tail_client[1])  # it read all there is, and waits
    assert subs[51][1].queue.empty()
    reads_before = tailer.reads

    everyone = [*requests, (shared, shared_epoch)]
    for step in range(4):  # a burst of 4 engine steps, 2 deltas each, then the ends
        await asyncio.gather(
            *(batcher.append(e, [delta(2 * step + 1), delta(2 * step + 2)]) for r, e in everyone)
        )
    await asyncio.gather(*(batcher.end(e, finished(e, END)) for r, e in everyone))

    rests = await asyncio.gather(
        *(collect(s, n - len(f)) for (_, s, n), f in zip(subs, firsts, strict=True))
    )
    delivered = sum(len(r) for r in rests)
    for (request_id, sub, n), first, rest in zip(subs, firsts, rests, strict=True):
        got = first + rest
        assert len(got) == n, (request_id, got)
        expected = await rlog.read(request_id)
        assert got == expected[len(expected) - n :]  # exactly its events, in order, no dups
        assert sub.queue.empty()
    assert tailer.reads - reads_before < delivered / 2, (tailer.reads, delivered)

    # a new log, subscribed while the tailer sits in XREAD BLOCK 10 s: served promptly
    await until_blocked(tailer, redis, tail_client[1])
    late, _ = await new_request(rlog)
    got = await asyncio.wait_for(collect(tailer.subscribe(late), 1), 3)
    assert got[0][1] == created()


async def test_tailer_shards_logs_and_reuses_room(
    rlog: RedisLog, batcher: AppendBatcher, tail_client: tuple[Redis, str], keys: Keys
):
    """Shards of at most ``shard_size`` logs (a read names only its shard's logs);
    two readers of one log share its shard; a freed place is taken again."""
    tailer = tailer_on(tail_client[0], keys, shard_size=7)
    await tailer.start()
    try:
        requests = [await new_request(rlog) for _ in range(20)]
        subs = [tailer.subscribe(r) for r, _ in requests]
        twin = tailer.subscribe(requests[0][0])
        assert tailer.shards == 3 and tailer.subscriptions == 21
        for _r, e in requests:
            await batcher.append(e, [delta(1)])
            await batcher.end(e, finished(e, END))
        got = await asyncio.wait_for(asyncio.gather(*(collect(s, 3) for s in [*subs, twin])), 5)
        for (r, _), events in zip([*requests, requests[0]], got, strict=True):
            assert events == await rlog.read(r)
        for sub in [*subs, twin]:
            sub.close()
        assert tailer.subscriptions == 0
        again = [await new_request(rlog) for _ in range(7)]
        fresh = [tailer.subscribe(r) for r, _ in again]
        assert tailer.shards == 3  # the empty shards took them
        firsts = await asyncio.wait_for(asyncio.gather(*(collect(s, 1) for s in fresh)), 5)
        assert all(b[0][1] == created() for b in firsts)
    finally:
        await tailer.stop()


def resp(*parts: bytes) -> bytes:
    return b"*%d\r\n" % len(parts) + b"".join(b"$%d\r\n%s\r\n" % (len(p), p) for p in parts)


async def test_tailer_late_subscriber_from_start_gets_no_gap(
    rlog: RedisLog, redis: Redis, tailer: LogTailer, keys: Keys, tail_client: tuple[Redis, str]
):
    """A reader joining a followed log further back while the tailer's XREAD is in flight.

    The race is forced: an entry is written (a raw XADD, sent synchronously) and the reader
    subscribes before the tailer can see the reply, so that read's batch starts past the new
    reader's position. It must not be handed to it (regression: it was, a gap).
    """
    request_id, epoch = await new_request(rlog)
    await rlog.append(request_id, epoch.epoch, [delta(1)])
    first = tailer.subscribe(request_id)
    assert len(await collect(first, 2)) == 2
    # the tailer is blocked again, reading this log after delta(1)
    await until_blocked(tailer, redis, tail_client[1])

    kw = rlog.redis.connection_pool.connection_kwargs
    reader, writer = await asyncio.open_connection(kw["host"], kw["port"])
    try:
        auth = [[b"AUTH", kw["password"].encode()]] if kw.get("password") else []
        for cmd in [*auth, [b"SELECT", str(kw.get("db", 0)).encode()]]:
            writer.write(resp(*cmd))
            assert (await reader.readline()).startswith(b"+OK")
        log_key, payload = keys.log(request_id).encode(), ev.encode(delta(2))
        writer.write(resp(b"XADD", log_key, b"*", b"e", payload))  # on the wire now
        resumed = tailer.subscribe(request_id)  # e.g. a reconnect without Last-Event-ID
        assert (await reader.readline()).startswith(b"$")
    finally:
        writer.close()
        await writer.wait_closed()
    got = await collect(resumed, 3, timeout=2)
    assert [e for _, e in got] == [created(), delta(1), delta(2)]
    assert [e for _, e in await collect(first, 1)] == [delta(2)]


async def test_tailer_survives_dropped_connection(
    rlog: RedisLog, redis: Redis, tailer: LogTailer, tail_client: tuple[Redis, str]
):
    requests = [await new_request(rlog) for _ in range(3)]
    subs = [tailer.subscribe(r) for r, _ in requests]
    for (r, e), sub in zip(requests, subs, strict=True):
        await rlog.append(r, e.epoch, [delta(1)])
        assert len(await collect(sub, 2)) == 2

    name = tail_client[1]
    blocked = await until_blocked(tailer, redis, name)
    assert len(blocked) == 1, blocked
    assert await redis.client_kill_filter(_id=blocked[0]["id"]) == 1

    for r, e in requests:  # appended while the tailer reconnects: nothing may be lost
        await rlog.append(r, e.epoch, [delta(2), delta(3)])
    for (r, _), sub in zip(requests, subs, strict=True):
        got = await collect(sub, 2)
        assert [e for _, e in got] == [delta(2), delta(3)]
        assert got == (await rlog.read(r))[2:]

    again = await until_blocked(tailer, redis, name)  # on a new connection
    assert len(again) == 1 and again[0]["id"] != blocked[0]["id"]
    for (r, e), sub in zip(requests, subs, strict=True):
        await rlog.append(r, e.epoch, [END], terminal_state="finished", ttl_s=60)
        assert [e for _, e in await collect(sub, 1)] == [END]


# -- RequestQueue -----------------------------------------------------------------------


async def test_queue_two_consumers_no_duplicates_and_ack(redis: Redis, keys: Keys):
    queue = RequestQueue(redis, keys)
    await queue.ensure_group()
    await queue.ensure_group()  # BUSYGROUP is fine
    jobs = [
        Job(request_id=rid(), prompt_token_ids=[1, i], params=SamplingParams(max_tokens=8, seed=i))
        for i in range(3)
    ]
    for job in jobs:
        await queue.enqueue(job)
    await queue.ensure_group()  # also on a stream that has entries
    assert await queue.depth() == 3

    a = await queue.read(0, "c1", count=2, block_ms=100)
    b = await queue.read(0, "c2", count=2, block_ms=100)
    assert (len(a), len(b)) == (2, 1)
    assert sorted((j for _, j in a + b), key=lambda j: j.params.seed or 0) == jobs
    assert await queue.read(0, "c1", count=2, block_ms=50) == []
    pending = await redis.xpending(keys.queue(0), QUEUE_GROUP)
    assert pending["pending"] == 3
    assert {c["name"]: c["pending"] for c in pending["consumers"]} == {b"c1": 2, b"c2": 1}

    for entry_id, job in a + b:
        await queue.ack(job.request_id, entry_id)
    assert (await redis.xpending(keys.queue(0), QUEUE_GROUP))["pending"] == 0
    assert await queue.depth() == 0


async def test_pool_waits_for_a_connection_instead_of_failing(
    redis_url: str, key_prefix: str
) -> None:
    """A burst larger than the pool (the worker claiming 64 jobs on 64 connections while
    appends and heartbeats need some too) queues on the pool; none of it fails."""
    from service.store.pool import connect

    client = connect(redis_url, max_connections=2)
    try:
        key = f"{key_prefix}:empty-list"
        # each BLPOP holds its connection 50 ms: 8 of them need 4 rounds of the 2 connections
        results = await asyncio.gather(*(client.blpop([key], timeout=0.05) for _ in range(8)))
        assert results == [None] * 8
    finally:
        await client.aclose()


async def test_terminal_append_without_events_points_the_outbox_at_the_last_entry(
    rlog: RedisLog, redis: Redis, keys: Keys
):
    request_id, epoch = await new_request(rlog)
    [last_id] = await rlog.append(request_id, epoch.epoch, [delta(1)])
    assert (
        await rlog.append(
            request_id, epoch.epoch, [], terminal_state="cancelled", ttl_s=60, summary=b"s"
        )
        == []
    )
    [(_, fields)] = await redis.xrange(keys.outbox(0), count=1)
    assert fields[b"i"].decode() == str(last_id)
    assert (await rlog.meta(request_id)).state == "cancelled"  # type: ignore[union-attr]


async def test_a_lease_that_could_not_be_written_is_not_kept(redis: Redis, keys: Keys):
    """A reader that goes away while its lease is being written (or a Redis error then)
    must not leave a lease this process refreshes for ever."""
    from service.store.readers import Presence, Readers

    control = Readers(redis, keys)
    presence = Presence(control, **LEASES)

    async def failing(*_a: object, **_k: object) -> None:
        raise ConnectionError("redis went away")

    control.lease = failing  # type: ignore[method-assign,assignment]
    with pytest.raises(ConnectionError):
        await presence.acquire(rid())
    assert len(presence) == 0


# -- retries after a lost reply -----------------------------------------------------------


async def test_an_append_sent_twice_is_written_once(rlog: RedisLog):
    """A flush whose reply was lost (Redis restarted, a connection reset) is sent again
    with the same position: the second call answers the first call's ids."""
    request_id, owner = await new_request(rlog)
    first = await rlog.append(request_id, owner.epoch, [delta(1), delta(2)], expect=1)
    again = await rlog.append(request_id, owner.epoch, [delta(1), delta(2)], expect=1)
    assert again == first
    end = [END]
    ended = await rlog.append(
        request_id, owner.epoch, end, terminal_state="finished", ttl_s=60, summary=b"s", expect=3
    )
    repeated = await rlog.append(
        request_id, owner.epoch, end, terminal_state="finished", ttl_s=60, summary=b"s", expect=3
    )
    assert repeated == ended
    assert [e for _, e in await rlog.read(request_id)] == [created(), delta(1), delta(2), END]
    assert await rlog.redis.xlen(rlog.keys.outbox(0)) == 1  # one outbox entry, not two


async def test_an_append_after_lost_entries_is_refused(rlog: RedisLog):
    """The log holds fewer entries than its owner wrote (Redis lost the tail): the
    owner is told, nothing is written after the hole."""
    request_id, owner = await new_request(rlog)
    with pytest.raises(LogGap):
        await rlog.append(request_id, owner.epoch, [delta(5)], expect=4)
    assert [e for _, e in await rlog.read(request_id)] == [created()]


async def test_a_claim_sent_twice_keeps_the_epoch(rlog: RedisLog):
    request_id, owner = await new_request(rlog)
    again = await rlog.claim(request_id, "w1")  # w1's claim again: its reply was lost
    assert again is not None and again.epoch == owner.epoch
    taken = await rlog.claim(request_id, "w2")
    assert taken is not None and taken.epoch == owner.epoch + 1


async def test_the_batcher_counts_where_the_log_is(rlog: RedisLog, batcher: AppendBatcher):
    request_id, owner = await new_request(rlog)
    await batcher.append(owner, [delta(1)])
    await batcher.append(owner, [delta(2), delta(3)])
    assert owner.events == 4 == await rlog.redis.xlen(rlog.keys.log(request_id))


async def test_an_append_to_a_request_redis_forgot_is_gone(rlog: RedisLog, redis: Redis):
    """Redis restarted without its data: the owner learns the request is gone (not that
    another worker took it over), so it can still give the ledger its row."""
    request_id, owner = await new_request(rlog)
    await redis.delete(rlog.keys.meta(request_id), rlog.keys.log(request_id))
    with pytest.raises(LogGone):
        await rlog.append(request_id, owner.epoch, [delta(1)], expect=owner.events)
    assert not await redis.exists(rlog.keys.log(request_id))
