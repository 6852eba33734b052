"""Parking in a real Redis: ``owner_verdicts.lua``'s park verdict, ``park.lua`` (parked, or -- a
reader came back meanwhile -- queued again at once), and ``lease_and_unpark.lua`` making a parked
request go on once, however many readers come back."""

from __future__ import annotations

import time
import uuid

import pytest
from redis.asyncio import Redis

from service.settings import Settings
from service.store import replies
from service.store.keys import TAKEOVER_ENTRY, Keys
from service.store.log import Owner, RedisLog
from service.store.owner import OwnerChannel
from service.store.queue import Job, RequestQueue, encode_job
from service.store.readers import Presence, Readers
from service.stream import events as ev
from service.stream.lifecycle import Meta, State, Verdict
from service.stream.params import SamplingParams

DEFAULTS = Settings()  # the numbers a process takes unless told (LASTEVENT_*)
LEASES = {"lease_ttl_s": DEFAULTS.lease_ttl_s, "refresh_s": DEFAULTS.lease_refresh_s}

pytestmark = pytest.mark.timeout(30)

FIRST = ev.Created(kind="chat", model="m", created=0, prompt_tokens=2)


async def running(rlog: RedisLog, queue: RequestQueue, grace_ms: int) -> tuple[str, bytes]:
    """A request read by a worker, its queue entry pending, no reader."""
    await queue.ensure_group()
    rid = f"chatcmpl-{uuid.uuid4().hex}"
    job = encode_job(Job(rid, [1, 2], SamplingParams(max_tokens=8)))
    await rlog.create(rid, FIRST, 600, grace_ms=grace_ms, job=job)
    [(entry, _)] = await queue.read(rlog.keys.partition(rid), "w1", count=1, block_ms=100)
    return rid, entry


async def claimed(rlog: RedisLog, redis: Redis, keys: Keys) -> tuple[str, bytes, Owner]:
    """As ``running``, with a long resume window, and claimed by its worker."""
    rid, entry = await running(rlog, RequestQueue(redis, keys), grace_ms=60_000)
    owner = await rlog.claim(rid, "w1", entry)
    assert owner is not None
    return rid, entry, owner


async def field(redis: Redis, keys: Keys, rid: str, name: Meta) -> str | None:
    return replies.text_or_none(await redis.hget(keys.meta(rid), name))


async def test_the_owner_is_told_to_park_after_the_delay_or_to_abandon(
    rlog: RedisLog, redis: Redis, keys: Keys
) -> None:
    queue = RequestQueue(redis, keys)
    control = OwnerChannel(redis, keys)
    long_window, _ = await running(rlog, queue, grace_ms=60_000)
    short_window, _ = await running(rlog, queue, grace_ms=200)
    for rid in (long_window, short_window):
        assert await rlog.claim(rid, "w1") is not None
    # no reader from now: the first is parked after the delay, the second (a window no
    # longer than the delay) abandoned at its window's end, as before parking
    first = await control.check([long_window, short_window], park_after_ms=500)
    assert -500 <= first[long_window] < 0 and -200 <= first[short_window] < 0
    await redis.hset(keys.meta(long_window), Meta.GONE_MS, int(time.time() * 1000) - 600)
    await redis.hset(keys.meta(short_window), Meta.GONE_MS, int(time.time() * 1000) - 600)
    later = await control.check([long_window, short_window], park_after_ms=500)
    assert later == {long_window: Verdict.PARK, short_window: Verdict.ABANDONED}
    never = await control.check([long_window], park_after_ms=-1)  # parking off
    assert never[long_window] < 0  # abandoned when its window is over, as before


async def test_one_check_decides_each_of_many_requests_as_alone(
    rlog: RedisLog, redis: Redis, keys: Keys
) -> None:
    """The owner's periodic check asks about all its requests in one call: each gets the
    verdict it would get alone -- cancelled, detached, a live reader (its lapsed lease
    beside it dropped, the moment it was left forgotten), a reader whose lease lapsed
    (left since then), one Redis lost (not made again)."""
    queue = RequestQueue(redis, keys)
    control = OwnerChannel(redis, keys)
    rids = [(await running(rlog, queue, grace_ms=60_000))[0] for _ in range(5)]
    cancelled, detached, live, lapsed, lost = rids
    now = int(time.time() * 1000)
    await redis.hset(keys.meta(cancelled), Meta.CANCEL, 1)
    await redis.hset(keys.meta(detached), Meta.DETACHED, 1)
    await redis.zadd(keys.readers(live), {"a": now + 60_000, "old": now - 5_000})
    await redis.hset(keys.meta(live), Meta.GONE_MS, now - 5_000)
    await redis.zadd(keys.readers(lapsed), {"a": now - 3_000, "b": now - 700})
    await redis.delete(keys.meta(lost), keys.readers(lost))
    got = await control.check(rids, park_after_ms=500)
    assert got[cancelled] == Verdict.CANCELLED
    assert got[detached] == got[live] == got[lost] == Verdict.KEEP_GOING
    assert got[lapsed] == Verdict.PARK  # left 700 ms ago, parked after 500
    assert await redis.zrange(keys.readers(live), 0, -1) == [b"a"]
    assert await field(redis, keys, live, Meta.GONE_MS) is None
    assert await field(redis, keys, lapsed, Meta.GONE_MS) == str(now - 700)
    assert not await redis.exists(keys.readers(lapsed))
    assert not await redis.exists(keys.meta(lost))
    alone = {rid: (await control.check([rid], park_after_ms=500))[rid] for rid in rids}
    assert alone == {**got, live: Verdict.KEEP_GOING}


async def test_park_keeps_the_job_and_a_returning_reader_makes_it_go_on_once(
    rlog: RedisLog, redis: Redis, keys: Keys
) -> None:
    rid, entry, owner = await claimed(rlog, redis, keys)
    parked = await rlog.park(owner, entry, 3)
    assert parked.window_ms is not None and parked.entry_id is None
    assert await field(redis, keys, rid, Meta.STATE) == State.PARKED
    assert await field(redis, keys, rid, Meta.DISCARDED) == "3"
    assert await redis.xlen(keys.queue_of(rid)) == 0  # its entry acked and deleted
    assert await redis.zscore(keys.parked_of(rid), rid) == parked.window_ms
    assert await rlog.claim(rid, "w2", entry) is None  # nothing to take over
    presence = Presence(Readers(redis, keys), **LEASES)
    back = [await presence.acquire(rid) for _ in range(3)]  # three readers come back
    assert [lease.unparked for lease in back] == [True, False, False]
    assert await field(redis, keys, rid, Meta.STATE) == State.RUNNING
    # queued again, once, in the takeover queue (ahead of fresh work)
    assert await redis.xlen(keys.queue_of(rid)) == 0
    assert await redis.xlen(keys.takeovers(keys.partition(rid))) == 1
    assert await redis.zscore(keys.parked_of(rid), rid) is None
    assert await redis.zscore(keys.orphans_of(rid), rid) is not None  # (waits for a worker)
    new_entry = replies.text(await field(redis, keys, rid, Meta.ENTRY)).encode()
    assert new_entry.startswith(TAKEOVER_ENTRY)
    continuing = await rlog.claim(rid, "w2", new_entry)
    # fenced by the park, the unpark and its own claim
    assert continuing is not None and continuing.epoch == owner.epoch + 3
    recovery = await rlog.resumed(continuing, 5)
    assert (recovery.parks, recovery.discarded_tokens) == (1, 3)
    assert recovery.returned_ms > 0
    assert (await rlog.resumed(continuing, 0)).returned_ms == 0  # answered once


async def test_a_reader_back_as_it_is_parked_makes_it_go_on_at_once(
    rlog: RedisLog, redis: Redis, keys: Keys
) -> None:
    rid, entry, owner = await claimed(rlog, redis, keys)
    await Presence(Readers(redis, keys), **LEASES).acquire(rid)  # back before the park was written
    parked = await rlog.park(owner, entry, 0)
    assert parked.window_ms is None and parked.entry_id is not None
    assert await field(redis, keys, rid, Meta.STATE) == State.RUNNING
    assert await field(redis, keys, rid, Meta.ENTRY) == parked.entry_id.decode()
    assert await redis.zscore(keys.parked_of(rid), rid) is None
    assert await field(redis, keys, rid, Meta.PARKS) is None  # it never was
