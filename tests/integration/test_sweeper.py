"""The sweeper, against a real Redis: jobs nobody serves are queued again or ended."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest
from redis.asyncio import Redis

from service.api.sweeper import Sweeper
from service.settings import Settings
from service.store.heartbeats import Heartbeat, Heartbeats
from service.store.keys import QUEUE_GROUP, TAKEOVER_ENTRY, Keys
from service.store.log import Fenced, Recovery, RedisLog
from service.store.queue import Job, RequestQueue, encode_job
from service.stream import endings
from service.stream import events as ev
from service.stream.lifecycle import Requeue, State
from service.stream.params import SamplingParams

pytestmark = pytest.mark.timeout(30)

DEFAULTS = Settings()  # the numbers a process takes unless told (LASTEVENT_*)


def make_sweeper(log: RedisLog, queue: RequestQueue, beats: Heartbeats, **given: Any) -> Sweeper:
    """A sweeper with a process's default numbers, but those ``given``."""
    numbers: dict[str, Any] = {
        "stale_s": DEFAULTS.worker_stale_s,
        "interval_s": DEFAULTS.sweep_interval_s,
        "max_takeovers": DEFAULTS.max_takeovers,
        "takeover_wait_s": DEFAULTS.takeover_wait_s,
        "request_deadline_s": DEFAULTS.request_deadline_s,
        "connection_grace_s": DEFAULTS.worker_connection_grace_s,
        "connection_poll_s": DEFAULTS.worker_connection_poll_s,
    }
    return Sweeper(log, queue, beats, sweeper_id="s1", **{**numbers, **given})


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
    [(old_entry, _)] = await queue.read(0, "frozen", count=1, block_ms=100)  # then it froze
    await beats.beat("frozen", Heartbeat(1, 1, int(time.time() * 1000) - 60_000, 0))
    sweeper = make_sweeper(log, queue, beats, stale_s=0.05)
    time.sleep(0.1)  # the entry's idle time: the sweeper only takes what idled stale_s
    assert await sweeper.sweep() == 1
    [(new_entry, job)] = await queue.read(0, "healthy", count=1, block_ms=100)
    assert job.request_id == rid and new_entry != old_entry
    assert await log.claim(rid, "frozen", old_entry) is None  # it woke up: refused
    owner = await log.claim(rid, "healthy", new_entry)
    assert owner is not None and owner.epoch == 1
    assert (await log.meta(rid)).owner == "healthy"  # type: ignore[union-attr]


async def lose(log: RedisLog, queue: RequestQueue, beats: Heartbeats, rid: str, worker: str):
    """``worker`` reads the request's job, claims it, writes a delta, and dies."""
    [(entry, _)] = await queue.read(0, worker, count=1, block_ms=100)
    owner = await log.claim(rid, worker, entry)
    assert owner is not None
    await log.append(rid, owner.epoch, [ev.Delta("hi", [5], 1)])
    await beats.beat(worker, Heartbeat(1, 1, int(time.time() * 1000) - 60_000, 0))
    time.sleep(0.1)  # the entry's idle time: the sweeper only takes what idled stale_s
    return entry, owner


async def test_a_started_job_of_a_dead_worker_is_queued_for_a_takeover(
    redis: Redis, key_prefix: str
):
    keys = Keys(key_prefix)
    log, queue, beats = RedisLog(redis, keys), RequestQueue(redis, keys), Heartbeats(redis, keys)
    await queue.ensure_group()
    rid = await submitted(log, queue)
    old_entry, old = await lose(log, queue, beats, rid, "dead")
    assert await make_sweeper(log, queue, beats, stale_s=0.05).sweep() == 1
    # the old owner is fenced out at once, before anyone claims
    with pytest.raises(Fenced):
        await log.append(rid, old.epoch, [ev.Delta("x", [6], 2)])
    meta = await log.meta(rid)
    assert meta is not None and meta.state == State.RUNNING and not meta.owner
    assert meta.recovery.takeovers == 1
    assert await queue.orphans_due(int(time.time() * 1000) + 10**9) == [rid]
    [(new_entry, job)] = await queue.read(0, "next", count=1, block_ms=100)
    assert job.request_id == rid and new_entry != old_entry
    assert await log.claim(rid, "dead", old_entry) is None  # its old entry claims nothing
    owner = await log.claim(rid, "next", new_entry)
    assert owner is not None and owner.epoch > old.epoch and owner.events == 2
    recovery = await log.resumed(owner, 1 + 1)  # the prompt and the logged token
    assert recovery == Recovery(takeovers=1, handovers=0, reprefill_tokens=2)
    with pytest.raises(Fenced):
        await log.resumed(old, 2)


async def test_a_request_lost_too_often_ends_worker_lost(redis: Redis, key_prefix: str):
    keys = Keys(key_prefix)
    log, queue, beats = RedisLog(redis, keys), RequestQueue(redis, keys), Heartbeats(redis, keys)
    await queue.ensure_group()
    rid = await submitted(log, queue)
    sweeper = make_sweeper(log, queue, beats, stale_s=0.05, max_takeovers=1)
    await lose(log, queue, beats, rid, "first")
    assert await sweeper.sweep() == 1
    await lose(log, queue, beats, rid, "second")
    assert await sweeper.sweep() == 1
    meta = await log.meta(rid)
    assert meta is not None and meta.state == State.ERRORED
    entries = [e for _, e in await log.read(rid)]
    assert isinstance(entries[-2], ev.Error) and entries[-2].code == "worker_lost"
    end = entries[-1]
    assert isinstance(end, ev.End) and end.takeovers == 1 and end.completion_tokens == 1
    assert await queue.pending(0, "s1") == []  # the entry is acked


async def test_a_takeover_nobody_takes_ends_at_its_wait(redis: Redis, key_prefix: str):
    keys = Keys(key_prefix)
    log, queue, beats = RedisLog(redis, keys), RequestQueue(redis, keys), Heartbeats(redis, keys)
    await queue.ensure_group()
    rid = await submitted(log, queue)
    sweeper = make_sweeper(log, queue, beats, stale_s=0.05, takeover_wait_s=0.05)
    await lose(log, queue, beats, rid, "dead")
    assert await sweeper.sweep() == 1
    time.sleep(0.1)
    assert await sweeper.end_unclaimed() == 1
    meta = await log.meta(rid)
    assert meta is not None and meta.state == State.ERRORED
    assert await queue.orphans_due(int(time.time() * 1000) + 10**9) == []
    # the job still queued behind it is acked by the worker that reads it: nothing to run
    [(entry, _)] = await queue.read(0, "late", count=1, block_ms=100)
    assert await log.claim(rid, "late", entry) is None


async def test_a_claimed_takeover_is_not_ended_at_its_wait(redis: Redis, key_prefix: str):
    keys = Keys(key_prefix)
    log, queue, beats = RedisLog(redis, keys), RequestQueue(redis, keys), Heartbeats(redis, keys)
    await queue.ensure_group()
    rid = await submitted(log, queue)
    sweeper = make_sweeper(log, queue, beats, stale_s=0.05, takeover_wait_s=0.05)
    await lose(log, queue, beats, rid, "dead")
    assert await sweeper.sweep() == 1
    [(entry, _)] = await queue.read(0, "next", count=1, block_ms=100)
    assert await log.claim(rid, "next", entry) is not None
    time.sleep(0.1)
    assert await sweeper.end_unclaimed() == 0
    meta = await log.meta(rid)
    assert meta is not None and meta.state == State.RUNNING and meta.owner == "next"


async def test_a_handover_is_fenced_by_the_owners_epoch(redis: Redis, key_prefix: str):
    keys = Keys(key_prefix)
    log, queue = RedisLog(redis, keys), RequestQueue(redis, keys)
    await queue.ensure_group()
    rid = await submitted(log, queue)
    [(entry, _)] = await queue.read(0, "stopping", count=1, block_ms=100)
    owner = await log.claim(rid, "stopping", entry)
    assert owner is not None
    stale = await queue.requeue(rid, entry, Requeue.HANDOVER, epoch=owner.epoch + 1)
    assert stale.entry_id is None  # not the owner's epoch: nothing happens
    done = await queue.requeue(rid, entry, Requeue.HANDOVER, epoch=owner.epoch)
    assert done.entry_id is not None
    meta = await log.meta(rid)
    assert meta is not None and meta.recovery == Recovery(takeovers=0, handovers=1)
    assert (await queue.requeue(rid, entry, Requeue.HANDOVER, epoch=owner.epoch)).entry_id is None


async def test_a_live_workers_running_jobs_are_left_alone(redis: Redis, key_prefix: str):
    keys = Keys(key_prefix)
    log, queue, beats = RedisLog(redis, keys), RequestQueue(redis, keys), Heartbeats(redis, keys)
    await queue.ensure_group()
    served, lost = await submitted(log, queue), await submitted(log, queue)
    await queue.read(0, "alive", count=2, block_ms=100)
    # a fresh heartbeat that names only one of them: the other one it lost track of
    time.sleep(0.1)
    fresh = int(time.time() * 1000) + 60_000  # fresh whatever the sweep's timing
    await beats.beat("alive", Heartbeat(2, 1, fresh, 0, frozenset({served})))
    assert await make_sweeper(log, queue, beats, stale_s=0.05).sweep() == 1
    assert [p.job.request_id for p in await queue.pending(0, "alive") if p.job] == [served]
    [(_, again)] = await queue.read(0, "other", count=1, block_ms=100)
    assert again.request_id == lost


async def test_a_store_outage_is_not_staleness(redis: Redis, key_prefix: str):
    """After the store was away (a failover, a restart), a worker whose last heartbeat
    looks stale is not taken over until it had ``stale_s`` of a reachable store to beat
    again; nor after the store lost the heartbeats of workers that hold jobs."""
    keys = Keys(key_prefix)
    log, queue, beats = RedisLog(redis, keys), RequestQueue(redis, keys), Heartbeats(redis, keys)
    await queue.ensure_group()
    rid = await submitted(log, queue)
    await lose(log, queue, beats, rid, "alive")  # its heartbeat: a minute old
    sweeper = make_sweeper(log, queue, beats, stale_s=0.3)
    sweeper.store_lost()  # (what the sweeper's loop calls when a round failed)
    assert await sweeper.sweep() == 0
    time.sleep(0.35)  # the store is back; the worker beats again, as a live one does
    await beats.beat("alive", Heartbeat(1, 1, int(time.time() * 1000), 0, frozenset({rid})))
    assert await sweeper.sweep() == 0  # alive: not taken over
    # the store lost the heartbeats hash: not judged for stale_s either
    await redis.delete(keys.workers)
    assert await sweeper.sweep() == 0
    time.sleep(0.35)  # and this worker never beat again: it is lost
    assert await sweeper.sweep() == 1


async def test_a_takeover_is_read_ahead_of_a_backlog_of_fresh_work(redis: Redis, key_prefix: str):
    keys = Keys(key_prefix)
    log, queue, beats = RedisLog(redis, keys), RequestQueue(redis, keys), Heartbeats(redis, keys)
    await queue.ensure_group()
    lost = [await submitted(log, queue) for _ in range(2)]
    for i, rid in enumerate(lost):
        await lose(log, queue, beats, rid, f"dead{i}")
    backlog = [await submitted(log, queue) for _ in range(3)]  # fresh work waiting
    assert await make_sweeper(log, queue, beats, stale_s=0.05).sweep() == 2
    assert await queue.depth() == 5
    # a read for one job per queue: the takeover queue's comes first (a worker with one
    # free slot runs it, and gives the fresh one back)
    first = await queue.read(0, "next", count=1, block_ms=100)
    assert [j.request_id for _, j in first] == [lost[0], backlog[0]]
    assert first[0][0].startswith(TAKEOVER_ENTRY) and not first[1][0].startswith(TAKEOVER_ENTRY)
    got = await queue.read(0, "next", count=2, block_ms=100)
    assert [j.request_id for _, j in got] == [lost[1], *backlog[1:]]
    # each entry is acknowledged in its own queue
    for e, j in [*first, *got]:
        await queue.ack(j.request_id, e)
    assert [(await redis.xpending(s, QUEUE_GROUP))["pending"] for s in queue.streams(0)] == [0, 0]
    assert await queue.depth() == 0


async def test_a_continuation_a_frozen_worker_was_handed_moves_without_a_takeover(
    redis: Redis, key_prefix: str
):
    """A frozen process's blocked read, sent before it froze, is handed a continuation:
    taken from it, the request moves on, but no second worker was lost with it."""
    keys = Keys(key_prefix)
    log, queue, beats = RedisLog(redis, keys), RequestQueue(redis, keys), Heartbeats(redis, keys)
    await queue.ensure_group()
    rid = await submitted(log, queue)
    await lose(log, queue, beats, rid, "dead")
    sweeper = make_sweeper(log, queue, beats, stale_s=0.05)
    assert await sweeper.sweep() == 1
    epoch = (await log.meta(rid)).epoch  # type: ignore[union-attr]
    [(handed, _)] = await queue.read(0, "frozen", count=1, block_ms=100)
    assert await sweeper.take_over("frozen") == 1
    meta = await log.meta(rid)
    assert meta is not None and (meta.recovery.takeovers, meta.epoch) == (1, epoch)
    [(entry, job)] = await queue.read(0, "next", count=1, block_ms=100)
    assert job.request_id == rid and entry != handed
    assert await log.claim(rid, "frozen", handed) is None  # it wakes: refused
    owner = await log.claim(rid, "next", entry)
    assert owner is not None and owner.epoch == epoch + 1


async def test_fresh_jobs_a_read_handed_beyond_the_slots_go_back_to_the_front(
    redis: Redis, key_prefix: str
):
    """A worker gives back the fresh jobs of a read beyond its free slots: each is queued
    again in the takeover queue (ahead of the fresh ones behind it, for any worker); one
    cancelled meanwhile is only acknowledged."""
    keys = Keys(key_prefix)
    log, queue = RedisLog(redis, keys), RequestQueue(redis, keys)
    await queue.ensure_group()
    rids = [await submitted(log, queue) for _ in range(4)]
    handed = await queue.read(0, "busy", count=2, block_ms=100)
    assert [j.request_id for _, j in handed] == rids[:2]
    cancelled = endings.cancelled_queued(endings.Request(rids[1], None, 1, 0))
    assert (await RedisLog(redis, keys).cancel(rids[1], cancelled)).outcome == State.CANCELLED
    await queue.give_back(handed)
    assert (await redis.xpending(keys.queue(0), QUEUE_GROUP))["pending"] == 0
    got = await queue.read(0, "idle", count=1, block_ms=100)
    # the given-back job first (from the takeover queue), then the oldest fresh one
    assert [j.request_id for _, j in got] == [rids[0], rids[2]]
    assert got[0][0].startswith(TAKEOVER_ENTRY)
