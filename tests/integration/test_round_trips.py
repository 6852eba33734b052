"""Round trips saved on the hot paths, against a real Redis (no mocks):

* ``AppendBatcher(interval_s=...)``: a flush goes no sooner than ``interval_s`` after the
  previous one; what is appended meanwhile rides in that one flush.
* ``RedisLog.claim`` answers the log's first entry (the ``created`` event) in the same
  script call, so a worker starting a request needs no read of its own.
* A terminal append with ``ack`` acknowledges and deletes the job's queue entry in the
  same script call -- and only when the end is written.
* ``Lease.ended``: a reader that delivered the terminal event releases its lease without
  a round trip (the end's script already dropped the readers set).

Each test works under its own random key prefix (the ``key_prefix`` fixture), so the file
runs in parallel and twice in a row against one shared server.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from redis.asyncio import Redis

from service.settings import Settings
from service.store.batcher import AppendBatcher
from service.store.keys import QUEUE_GROUP, Keys
from service.store.log import (
    AlreadyEnded,
    Append,
    Fenced,
    LogGap,
    Owner,
    RedisLog,
)
from service.store.queue import Job, RequestQueue, encode_job
from service.store.readers import Presence, Readers
from service.stream import events as ev
from service.stream.lifecycle import Meta
from service.stream.params import SamplingParams
from tests.integration.conftest import finished

DEFAULTS = Settings()  # the numbers a process takes unless told (LASTEVENT_*)
LEASES = {"lease_ttl_s": DEFAULTS.lease_ttl_s, "refresh_s": DEFAULTS.lease_refresh_s}

pytestmark = pytest.mark.timeout(60)

CREATED_AT = int(time.time())
END = ev.End(state="finished", finish_reason="stop", prompt_tokens=3, completion_tokens=8)
SAFETY_NET_S = 20.0  # never reached unless something hangs: not a duration assertion


def created() -> ev.Created:
    return ev.Created(kind="chat", model="m", created=CREATED_AT, prompt_tokens=3)


def delta(i: int) -> ev.Delta:
    return ev.Delta(text=f"t{i}", token_ids=[i], n=i)


def rid() -> str:
    return uuid.uuid4().hex


def job_for(request_id: str) -> Job:
    return Job(
        request_id=request_id, prompt_token_ids=[1, 2, 3], params=SamplingParams(max_tokens=5)
    )


@contextlib.asynccontextmanager
async def running(log: RedisLog, interval_s: float = 0.0) -> AsyncIterator[AppendBatcher]:
    batcher = AppendBatcher(log, interval_s=interval_s)
    batcher.start()
    try:
        yield batcher
    finally:
        await batcher.close()


async def new_request(log: RedisLog, request_id: str | None = None) -> tuple[str, Owner]:
    """A created request claimed by w1: its id and its owner (epoch 1)."""
    request_id = request_id or rid()
    await log.create(request_id, created(), 600)
    owner = await log.claim(request_id, "w1")
    assert owner is not None and owner.epoch == 1 and owner.events == 1
    return request_id, owner


async def queued_request(
    log: RedisLog, queue: RequestQueue, request_id: str | None = None
) -> tuple[str, bytes]:
    """A request created with its job (as the submit path does) and read by consumer c1,
    so that its queue entry is pending under c1: its id and the entry id."""
    request_id = request_id or rid()
    await log.create(request_id, created(), 600, job=encode_job(job_for(request_id)))
    partition = log.keys.partition(request_id)
    [(entry_id, job)] = await queue.read(partition, "c1", count=10, block_ms=100)
    assert job.request_id == request_id
    return request_id, entry_id


async def pending(redis: Redis, queue_key: str) -> int:
    info: Any = await redis.xpending(queue_key, QUEUE_GROUP)
    return int(info["pending"])


async def queue_state(redis: Redis, queue_key: str) -> tuple[int, int]:
    """(entries pending in the group, entries in the stream)."""
    return await pending(redis, queue_key), int(await redis.xlen(queue_key))


# -- the flush interval -------------------------------------------------------------------


async def test_appends_within_the_interval_go_in_one_flush(rlog: RedisLog) -> None:
    requests = [await new_request(rlog) for _ in range(11)]
    (first_id, first_owner), rest = requests[0], requests[1:]
    async with running(rlog, interval_s=0.3) as batcher:
        # the first append after a quiet spell goes out at once, on its own
        ids = await asyncio.wait_for(batcher.append(first_owner, [delta(0)]), SAFETY_NET_S)
        assert batcher.round_trips == 1 and len(ids) == 1
        # ten appends made one after another while the interval runs; each gives the
        # batcher's loop a turn, so one that ignored the interval would send them apart
        tasks = []
        for i, (_, owner) in enumerate(rest, start=1):
            tasks.append(asyncio.create_task(batcher.append(owner, [delta(i), delta(i + 100)])))
            await asyncio.sleep(0.001)
        results = await asyncio.wait_for(asyncio.gather(*tasks), SAFETY_NET_S)
        assert batcher.round_trips == 2  # all ten in one further flush
        assert batcher.appends == 11
    assert [e for _, e in await rlog.read(first_id)] == [created(), delta(0)]
    assert [eid for eid, _ in await rlog.read(first_id)][1:] == ids
    for i, ((request_id, owner), got) in enumerate(zip(rest, results, strict=True), start=1):
        entries = await rlog.read(request_id)
        assert [e for _, e in entries] == [created(), delta(i), delta(i + 100)]
        assert [eid for eid, _ in entries[1:]] == got  # each got its own ids
        assert owner.events == 3


async def test_the_first_append_is_not_held_and_the_next_one_is(rlog: RedisLog) -> None:
    """With a long interval: the first append (nothing was sent before) goes at once; one
    made right after it waits for the interval -- it is not sent while Redis answers
    other calls meanwhile."""
    (a, owner_a), (b, owner_b) = await new_request(rlog), await new_request(rlog)
    async with running(rlog, interval_s=600.0) as batcher:
        await asyncio.wait_for(batcher.append(owner_a, [delta(1)]), SAFETY_NET_S)
        assert batcher.round_trips == 1
        held = asyncio.create_task(batcher.append(owner_b, [delta(2)]))
        for _ in range(20):  # round trips of our own: time for a flush to come back
            await rlog.redis.ping()
        assert not held.done()
        assert batcher.round_trips == 1
        assert [e for _, e in await rlog.read(b)] == [created()]  # not written
        held.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await held
    assert [e for _, e in await rlog.read(a)] == [created(), delta(1)]


async def test_without_an_interval_each_awaited_append_is_its_own_flush(rlog: RedisLog) -> None:
    request_id, owner = await new_request(rlog)
    async with running(rlog, interval_s=0.0) as batcher:
        for i in range(5):
            await asyncio.wait_for(batcher.append(owner, [delta(i)]), SAFETY_NET_S)
            assert batcher.round_trips == i + 1
    assert [e for _, e in await rlog.read(request_id)] == [created(), *(delta(i) for i in range(5))]


# -- claim answers the first entry ------------------------------------------------------


async def test_claim_returns_the_logs_first_entry(rlog: RedisLog, batcher: AppendBatcher) -> None:
    request_id = rid()
    created_id = await rlog.create(request_id, created(), 600)
    owner = await rlog.claim(request_id, "w1")
    assert owner is not None
    assert owner.first == (created_id, created())
    [(first_id, first_event)] = await rlog.read(request_id)
    assert owner.first == (first_id, first_event)
    # entries after it: still the first one, not the newest
    await batcher.append(owner, [delta(1), delta(2)])
    retry = await rlog.claim(request_id, "w1")  # the same worker again: a lost reply
    assert retry is not None
    assert (retry.epoch, retry.events, retry.first) == (1, 3, (created_id, created()))
    other = await rlog.claim(request_id, "w2")  # a takeover: a new epoch, the same first
    assert other is not None
    assert (other.epoch, other.events, other.first) == (2, 3, (created_id, created()))


async def test_claim_of_an_ended_or_unknown_request_is_none(
    rlog: RedisLog, batcher: AppendBatcher
) -> None:
    request_id, owner = await new_request(rlog)
    await batcher.end(owner, finished(owner, END))
    assert await rlog.claim(request_id, "w1") is None
    assert await rlog.claim(request_id, "w2") is None
    assert await rlog.claim(rid(), "w1") is None


async def test_claim_of_a_request_whose_log_is_gone_has_no_first(
    rlog: RedisLog, redis: Redis, keys: Keys
) -> None:
    request_id = rid()
    await rlog.create(request_id, created(), 600)
    await redis.delete(keys.log(request_id))  # Redis lost the log, not the meta
    owner = await rlog.claim(request_id, "w1")
    assert owner is not None and owner.epoch == 1
    assert owner.first is None


# -- the terminal append acknowledges the job ---------------------------------------------


async def test_the_end_acks_and_deletes_the_queue_entry(
    rlog: RedisLog, redis: Redis, keys: Keys, batcher: AppendBatcher
) -> None:
    queue = RequestQueue(redis, keys)
    await queue.ensure_group()
    request_id, entry_id = await queued_request(rlog, queue)
    queue_key = keys.queue_of(request_id)
    assert await queue_state(redis, queue_key) == (1, 1)
    owner = await rlog.claim(request_id, "w1", entry_id)
    assert owner is not None
    # a step that does not end the request acks nothing
    await batcher.append(owner, [delta(1)])
    assert await queue_state(redis, queue_key) == (1, 1)
    ids = await batcher.end(owner, finished(owner, END), ack=entry_id)
    assert len(ids) == 1
    assert await queue_state(redis, queue_key) == (0, 0)
    assert await redis.xrange(queue_key) == []
    assert [e for _, e in await rlog.read(request_id)] == [created(), delta(1), END]
    assert batcher.round_trips == 2  # the ack took no round trip of its own


async def test_a_refused_end_acks_nothing(
    rlog: RedisLog, redis: Redis, keys: Keys, batcher: AppendBatcher
) -> None:
    queue = RequestQueue(redis, keys)
    await queue.ensure_group()
    request_id, entry_id = await queued_request(rlog, queue)
    queue_key = keys.queue_of(request_id)
    stale = await rlog.claim(request_id, "w1", entry_id)
    assert stale is not None
    await batcher.append(stale, [delta(1)])
    current = await rlog.claim(request_id, "w2", entry_id)  # w1 is fenced out
    assert current is not None and current.epoch == stale.epoch + 1

    # fenced: nothing written, nothing acked
    with pytest.raises(Fenced):
        await batcher.end(stale, finished(stale, END), ack=entry_id)
    assert await queue_state(redis, queue_key) == (1, 1)
    assert [e for _, e in await rlog.read(request_id)] == [created(), delta(1)]
    meta = await rlog.meta(request_id)
    assert meta is not None and meta.state == "running" and meta.owner == "w2"

    # a gap (the log does not hold what the owner thinks): nothing acked
    [gap] = await rlog.append_many(
        [Append(request_id, current.epoch, [END], "finished", 60, expect=7, ack=entry_id)]
    )
    assert isinstance(gap, LogGap)
    assert await queue_state(redis, queue_key) == (1, 1)

    # already ended (by an end that did not ack): a second end acks nothing either
    await batcher.end(current, finished(current, END))
    assert await queue_state(redis, queue_key) == (1, 1)
    with pytest.raises(AlreadyEnded):
        await batcher.end(current, finished(current, END), ack=entry_id)
    assert await queue_state(redis, queue_key) == (1, 1)
    assert [e for _, e in await rlog.read(request_id)] == [created(), delta(1), END]


async def test_the_end_acks_in_its_own_partitions_queue(redis: Redis, key_prefix: str) -> None:
    """Four partitions, one request in each, all ending in one flush: each end acks its
    own partition's queue entry (a request outside partition 0 included)."""
    keys = Keys(key_prefix, partitions=4)
    log = RedisLog(redis, keys)
    queue = RequestQueue(redis, keys)
    await queue.ensure_group()
    found: dict[int, str] = {}
    while len(found) < keys.partitions:
        candidate = rid()
        found.setdefault(keys.partition(candidate), candidate)
    requests = []
    for p in keys.all_partitions:
        request_id, entry_id = await queued_request(log, queue, found[p])
        owner = await log.claim(request_id, "w1", entry_id)
        assert owner is not None
        requests.append((request_id, entry_id, owner))
    # one more in partition 0 that stays pending: the other ends must not touch it
    other_id = rid()
    while keys.partition(other_id) != 0:
        other_id = rid()
    _, other_entry = await queued_request(log, queue, other_id)
    assert [await queue_state(redis, keys.queue(p)) for p in keys.all_partitions] == [
        (2, 2),
        (1, 1),
        (1, 1),
        (1, 1),
    ]
    async with running(log) as batcher:
        await asyncio.wait_for(
            asyncio.gather(
                *(
                    batcher.end(owner, finished(owner, END), ack=entry)
                    for _, entry, owner in requests
                )
            ),
            SAFETY_NET_S,
        )
        assert batcher.round_trips == 1
    assert [await queue_state(redis, keys.queue(p)) for p in keys.all_partitions] == [
        (1, 1),
        (0, 0),
        (0, 0),
        (0, 0),
    ]
    # (entry ids are per stream: another partition's entry may have the same id)
    remaining: Any = await redis.xrange(keys.queue(0))
    assert [entry for entry, _ in remaining] == [other_entry]
    for request_id, _, _ in requests:
        assert [e for _, e in await log.read(request_id)] == [created(), END]


# -- a lease released after the end --------------------------------------------------------


async def meta_field(redis: Redis, keys: Keys, request_id: str, field: Meta) -> bytes | None:
    value: Any = await redis.hget(keys.meta(request_id), str(field))
    return None if value is None else bytes(value)


async def test_a_released_lease_leaves_and_an_ended_one_does_not(
    rlog: RedisLog, redis: Redis, keys: Keys
) -> None:
    presence = Presence(Readers(redis, keys), **LEASES)
    left_id, _ = await new_request(rlog)
    ended_id, _ = await new_request(rlog)
    left = await presence.acquire(left_id)
    ended = await presence.acquire(ended_id)
    assert left.adopted and ended.adopted and len(presence) == 2
    for lease in (left, ended):
        assert await redis.zscore(keys.readers(lease.request_id), lease.token) is not None
        assert await meta_field(redis, keys, lease.request_id, Meta.GONE_MS) is None

    left.delivered = 4
    await left.release()  # the last reader left: leave.lua runs
    assert await redis.zscore(keys.readers(left_id), left.token) is None
    assert await meta_field(redis, keys, left_id, Meta.GONE_MS) is not None
    assert await meta_field(redis, keys, left_id, Meta.DELIVERED) == b"4"

    ended.delivered = 4
    ended.ended = True
    await ended.release()  # no round trip: Redis is left as it was
    assert len(presence) == 0  # no longer refreshed either way
    assert await redis.zscore(keys.readers(ended_id), ended.token) is not None
    assert await meta_field(redis, keys, ended_id, Meta.GONE_MS) is None
    assert await meta_field(redis, keys, ended_id, Meta.DELIVERED) == b"0"


async def test_a_lease_released_after_the_end_does_not_touch_the_ended_request(
    rlog: RedisLog, redis: Redis, keys: Keys, batcher: AppendBatcher
) -> None:
    """The real order: the end drops the readers set; the reader that got it releases."""
    presence = Presence(Readers(redis, keys), **LEASES)
    request_id, owner = await new_request(rlog)
    lease = await presence.acquire(request_id)
    await batcher.end(owner, finished(owner, delta(1), END))
    assert not await redis.exists(keys.readers(request_id))
    lease.delivered = END.completion_tokens
    lease.ended = True
    await lease.release()
    assert len(presence) == 0
    assert not await redis.exists(keys.readers(request_id))
    assert await meta_field(redis, keys, request_id, Meta.GONE_MS) is None
    assert await meta_field(redis, keys, request_id, Meta.DELIVERED) == b"0"
    meta = await rlog.meta(request_id)
    assert meta is not None and meta.state == "finished"
