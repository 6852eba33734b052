"""Each model's queues (its lane), against a real Redis: a job waits where only workers of
its model read, a lost worker's started request goes back to its model's takeover queue,
and the models workers declare are kept."""

from __future__ import annotations

import itertools
import time

import pytest
from redis.asyncio import Redis

from service.api.request_ids import new_request_id
from service.store.heartbeats import Heartbeat, Heartbeats
from service.store.keys import Keys, model_lane
from service.store.log import RedisLog
from service.store.queue import Job, RequestQueue, encode_job
from service.store.registry import ModelRegistry
from service.stream import events as ev
from service.stream.events import Kind
from service.stream.params import SamplingParams
from tests.integration.test_sweeper import make_sweeper

pytestmark = pytest.mark.timeout(30)

BIG, SMALL = "big-model", "small-model"


def lanes(*models: str) -> list[str]:
    return [model_lane(m) for m in models]


async def submitted(log: RedisLog, model: str) -> str:
    rid = new_request_id(Kind.CHAT, model)
    job = Job(rid, [1], SamplingParams(max_tokens=3), model=model)
    created = ev.Created(kind="chat", model=model, created=0, prompt_tokens=1)
    await log.create(rid, created, 600, job=encode_job(job))
    return rid


@pytest.mark.parametrize("partitions", [1, 3])
async def test_a_job_waits_where_only_its_models_workers_read(
    redis: Redis, key_prefix: str, partitions: int
) -> None:
    keys = Keys(key_prefix, partitions)
    log = RedisLog(redis, keys)
    big, small = RequestQueue(redis, keys, lanes(BIG)), RequestQueue(redis, keys, lanes(SMALL))
    await big.ensure_group()
    await small.ensure_group()
    rids = {m: [await submitted(log, m) for _ in range(4)] for m in (BIG, SMALL)}
    for model, queue in ((BIG, big), (SMALL, small)):
        got = [
            job
            for p in keys.all_partitions
            for _, job in await queue.read(p, f"w-{model}", count=10, block_ms=20)
        ]
        assert sorted(j.request_id for j in got) == sorted(rids[model])
        assert {j.model for j in got} == {model}
    # admission's view: each model's queue length apart (all taken now: in the streams
    # until acknowledged)
    beats = Heartbeats(redis, keys)
    assert (await beats.live_with_depth(5, BIG))[1] == 4
    assert (await beats.live_with_depth(5, "another")) == ([], 0)


async def test_a_lost_workers_request_goes_back_to_its_models_lane(
    redis: Redis, key_prefix: str
) -> None:
    keys = Keys(key_prefix)
    log, beats = RedisLog(redis, keys), Heartbeats(redis, keys)
    big, small = RequestQueue(redis, keys, lanes(BIG)), RequestQueue(redis, keys, lanes(SMALL))
    swept = RequestQueue(redis, keys, ["", *lanes(BIG, SMALL)])  # what the catalog keeps
    await big.ensure_group()
    await small.ensure_group()
    rid = await submitted(log, BIG)
    [(entry, _)] = await big.read(0, "dead", count=1, block_ms=100)
    owner = await log.claim(rid, "dead", entry)
    assert owner is not None
    await log.append(rid, owner.epoch, [ev.Delta("hi", [5], 1)])
    await beats.beat("dead", Heartbeat(1, 1, int(time.time() * 1000) - 60_000, 0, models=(BIG,)))
    time.sleep(0.1)  # the entry's idle time: the sweeper only takes what idled stale_s
    assert await make_sweeper(log, swept, beats, stale_s=0.05).sweep() == 1
    assert await small.read(0, "other-model", count=10, block_ms=50) == []
    [(again, job)] = await big.read(0, "alive", count=10, block_ms=100)
    assert job.request_id == rid and again != entry
    assert await redis.xlen(keys.takeovers(0, model_lane(BIG))) == 1


async def test_declared_models_are_kept_with_their_base(redis: Redis, key_prefix: str) -> None:
    registry = ModelRegistry(redis, Keys(key_prefix))
    await registry.declare(BIG, ["sql", "tone"])
    await registry.declare(SMALL, [])
    first = await registry.declared()
    assert {n: d.parent for n, d in first.items()} == {
        BIG: None,
        "sql": BIG,
        "tone": BIG,
        SMALL: None,
    }
    time.sleep(1.1)
    await registry.declare(BIG, ["tone"])  # a worker with fewer adapters: nothing forgotten
    again = await registry.declared()
    assert again == first  # (created kept)


async def test_two_models_in_one_lane_are_refused(redis: Redis, key_prefix: str) -> None:
    seen: dict[str, str] = {}
    for i in itertools.count():  # a 32-bit collision: ~80,000 names on average
        name = f"m{i}"
        if (lane := model_lane(name)) in seen:
            twin = seen[lane]
            break
        seen[lane] = name
    registry = ModelRegistry(redis, Keys(key_prefix))
    await registry.declare(twin, [])
    with pytest.raises(ValueError, match="share a queue lane"):
        await registry.declare(name, [])
    with pytest.raises(ValueError, match="share a queue lane"):
        await registry.declare(BIG, [name])
