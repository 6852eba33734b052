"""The sweeper, against a real Redis: jobs nobody serves are queued again or ended."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from service.api.sweeper import Sweeper
from service.store.keys import Keys
from service.store.log import RedisLog
from service.store.queue import Heartbeat, Heartbeats, Job, RequestQueue, encode_job
from service.stream import events as ev
from service.stream.lifecycle import State
from service.stream.params import SamplingParams

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def redis(redis_url: str, key_prefix: str) -> AsyncIterator[Redis]:
    client = Redis.from_url(redis_url)
    yield client
    stale = [k async for k in client.scan_iter(match=f"{key_prefix}:*", count=1000)]
    if stale:
        await client.delete(*stale)
    await client.aclose()


async def submitted(log: RedisLog, queue: RequestQueue) -> str:
    rid = uuid.uuid4().hex
    job = Job(request_id=rid, prompt_token_ids=[1], params=SamplingParams(max_tokens=3))
    created = ev.Created(kind="chat", model="m", created=0, prompt_tokens=1)
    await log.create(rid, created, 600, job=encode_job(job))
    return rid


async def test_a_job_a_frozen_worker_took_is_queued_again(redis: Redis, key_prefix: str):
    keys = Keys(key_prefix)
    log, queue, beats = RedisLog(redis, keys), RequestQueue(redis, keys), Heartbeats(redis, keys)
    await queue.ensure_group()
    rid = await submitted(log, queue)
    [(old_entry, _)] = await queue.read("frozen", count=1, block_ms=100)  # then it froze
    await beats.beat("frozen", Heartbeat(1, 1, int(time.time() * 1000) - 60_000, 0))
    sweeper = Sweeper(log, queue, beats, sweeper_id="s1", stale_s=0.05)
    time.sleep(0.1)  # the entry's idle time: the sweeper only takes what idled stale_s
    assert await sweeper.sweep() == 1
    [(new_entry, job)] = await queue.read("healthy", count=1, block_ms=100)
    assert job.request_id == rid and new_entry != old_entry
    assert await log.claim(rid, "frozen", old_entry) is None  # it woke up: refused
    owner = await log.claim(rid, "healthy", new_entry)
    assert owner is not None and owner.epoch == 1
    assert (await log.meta(rid)).owner == "healthy"  # type: ignore[union-attr]


async def test_a_started_job_of_a_dead_worker_ends_worker_lost(redis: Redis, key_prefix: str):
    keys = Keys(key_prefix)
    log, queue, beats = RedisLog(redis, keys), RequestQueue(redis, keys), Heartbeats(redis, keys)
    await queue.ensure_group()
    rid = await submitted(log, queue)
    [(entry, _)] = await queue.read("dead", count=1, block_ms=100)
    assert await log.claim(rid, "dead", entry) is not None  # it started, then died
    await beats.beat("dead", Heartbeat(1, 1, int(time.time() * 1000) - 60_000, 0))
    time.sleep(0.1)
    assert await Sweeper(log, queue, beats, sweeper_id="s1", stale_s=0.05).sweep() == 1
    meta = await log.meta(rid)
    assert meta is not None and meta.state == State.ERRORED
    last = await log.last(rid)
    assert last is not None and isinstance(last[1], ev.End)


async def test_a_live_workers_running_jobs_are_left_alone(redis: Redis, key_prefix: str):
    keys = Keys(key_prefix)
    log, queue, beats = RedisLog(redis, keys), RequestQueue(redis, keys), Heartbeats(redis, keys)
    await queue.ensure_group()
    served, lost = await submitted(log, queue), await submitted(log, queue)
    await queue.read("alive", count=2, block_ms=100)
    # a fresh heartbeat that names only one of them: the other one it lost track of
    time.sleep(0.1)
    fresh = int(time.time() * 1000) + 60_000  # fresh whatever the sweep's timing
    await beats.beat("alive", Heartbeat(2, 1, fresh, 0, frozenset({served})))
    assert await Sweeper(log, queue, beats, sweeper_id="s1", stale_s=0.05).sweep() == 1
    assert [p.job.request_id for p in await queue.pending("alive") if p.job] == [served]
    [(_, again)] = await queue.read("other", count=1, block_ms=100)
    assert again.request_id == lost
