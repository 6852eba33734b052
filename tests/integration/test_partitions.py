"""Partitions on a real Redis (one node here; ``make test-cluster`` runs the e2e core on a
cluster): a flush over requests of several partitions, each partition's queue and
outbox on its own, reconcile's outbox range over all of them, and the admission slot
freed after an end -- by the writer, and by the recorder when the writer died first."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from redis.asyncio import Redis

from service.ledger.ledger import Ledger, make_engine
from service.settings import Settings
from service.store.keys import Keys
from service.store.log import Append, RedisLog
from service.store.outbox import Outbox
from service.store.queue import Job, RequestQueue
from service.stream import events as ev
from service.stream.lifecycle import FinishReason, State
from service.stream.params import SamplingParams
from tests import endings as endings_for_tests
from tests.waiting import eventually
from workers.recorder import Recorder

pytestmark = pytest.mark.timeout(60)

DEFAULTS = Settings()  # the numbers a process takes unless told (LASTEVENT_*)
RECORDER = {
    "claim_idle_ms": DEFAULTS.recorder_claim_idle_ms,
    "retention_s": DEFAULTS.outbox_retention_s,
    "crash_after_insert": DEFAULTS.recorder_crash_after_insert,
}

PARTITIONS = 4


@pytest.fixture
def keys(key_prefix: str) -> Keys:
    return Keys(key_prefix, PARTITIONS)


def one_per_partition(keys: Keys) -> list[str]:
    """A request id in each partition, in partition order."""
    found: dict[int, str] = {}
    while len(found) < keys.partitions:
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        found.setdefault(keys.partition(rid), rid)
    return [found[p] for p in keys.all_partitions]


def created(tenant: str = "t", key_id: str | None = "k1") -> ev.Created:
    return ev.Created(
        kind="chat", model="m", created=0, prompt_tokens=2, tenant=tenant, api_key_id=key_id
    )


async def end_in_the_log(log: RedisLog, rid: str, first: ev.Created) -> None:
    """A request created, claimed and ended (finished), its outbox entry written."""
    first_id = await log.create(rid, first, 60)
    owner = await log.claim(rid, "w")
    assert owner is not None
    end = ev.End("finished", "stop", 2, 0)
    summary = endings_for_tests.summary(rid, end, (first_id, first))
    await log.append(
        rid,
        owner.epoch,
        [end],
        terminal_state="finished",
        ttl_s=60,
        summary=ev.encode_summary(summary),
        expect=owner.events,
    )


async def test_a_flush_over_every_partition_writes_each_request_in_order(
    redis: Redis, keys: Keys
) -> None:
    log = RedisLog(redis, keys)
    rids = one_per_partition(keys)
    owners = []
    for rid in rids:
        await log.create(rid, created(), 60)
        owner = await log.claim(rid, "w")
        assert owner is not None
        owners.append(owner)
    slot = keys.inflight_of("t", "k1")
    await redis.zadd(slot, {rid: time.time() * 1000 + 60_000 for rid in rids})
    # two requests end in this flush, two go on; one append is fenced
    items = []
    for i, (rid, owner) in enumerate(zip(rids, owners, strict=True)):
        events: list[ev.Event] = [ev.Delta(text=f"x{i}", token_ids=[i], n=1)]
        ended = i % 2 == 0
        if ended:
            events.append(ev.End("finished", "stop", 2, 1))
        summary = ev.encode_summary(
            endings_for_tests.summary(rid, ev.End(State.FINISHED, FinishReason.STOP, 2, 1))
        )
        items.append(
            Append(
                rid,
                owner.epoch if i != 3 else owner.epoch + 7,
                events,
                "finished" if ended else "",
                60 if ended else 0,
                summary if ended else b"",
                owner.events,
                slot if ended else "",
            )
        )
    results = await log.append_many(items)
    assert [type(r).__name__ for r in results] == ["list", "list", "list", "Fenced"]
    for rid, result in zip(rids[:3], results[:3], strict=True):
        entries = await log.read(rid)
        assert [eid for eid, _ in entries[1:]] == result  # each its own, in its own log
    # each ended request's outbox entry is in its own partition's outbox
    for p, rid in enumerate(rids):
        raw = await redis.xrange(keys.outbox(p))
        assert len(raw) == (1 if p % 2 == 0 else 0), (p, rid)
    # the ended requests' admission slots are free, the running ones' are not
    left = {m.decode() for m in await redis.zrange(slot, 0, -1)}
    assert left == {rids[1], rids[3]}
    # reconcile's range sees every partition's ends, in end order
    summaries = await Outbox(redis, keys).ended_between(0, int(time.time() * 1000) + 1000)
    assert sorted(s.request_id for s, _ in summaries) == sorted([rids[0], rids[2]])
    ends = [end_id for _, end_id in summaries]
    assert ends == sorted(ends, key=lambda e: tuple(map(int, e.split("-"))))


async def test_each_partition_has_its_own_queue(redis: Redis, keys: Keys) -> None:
    queue = RequestQueue(redis, keys)
    await queue.ensure_group()
    rids = one_per_partition(keys)
    for rid in rids:
        await queue.enqueue(Job(rid, [1, 2], SamplingParams(max_tokens=3)))
    assert await queue.depth() == PARTITIONS
    for p, rid in enumerate(rids):
        [(entry, job)] = await queue.read(p, "w", count=10, block_ms=50)
        assert job.request_id == rid
        assert await queue.read(p, "w", count=10, block_ms=10) == []
        await queue.ack(rid, entry)
    assert await queue.depth() == 0


async def test_the_recorder_frees_a_slot_its_writer_left_taken(
    redis: Redis, keys: Keys, database_url: str
) -> None:
    """The writer of an end died before its ZREM: the recorder frees the slot."""
    log = RedisLog(redis, keys)
    outbox = Outbox(redis, keys)
    rid = one_per_partition(keys)[2]
    slot = keys.inflight_of("acme", None)
    await redis.zadd(slot, {rid: time.time() * 1000 + 60_000})
    # (no in-flight key given: as if the writer died before freeing it)
    await end_in_the_log(log, rid, created("acme", None))
    assert await redis.zscore(slot, rid) is not None
    engine = make_engine(database_url)
    recorder = Recorder(outbox, log, Ledger(engine), "rec", block_ms=50, **RECORDER)
    await outbox.ensure_group()
    [entry] = await outbox.read(2, "rec", 10, pending=False, block_ms=50)
    await recorder._record(2, entry)
    assert await redis.zscore(slot, rid) is None
    await engine.dispose()


class HangsOnce:
    """A real ledger whose first write never answers (a connection that hangs); with
    ``deaf``, that write does not even stop when cancelled (an await that swallows it)."""

    def __init__(self, ledger: Ledger, *, deaf: bool = False) -> None:
        self.ledger = ledger
        self.calls = 0
        self.deaf = deaf
        self.released = asyncio.Event()

    async def record(self, *args: object) -> bool:
        self.calls += 1
        if self.calls == 1:
            while True:
                try:
                    await self.released.wait()
                    break
                except asyncio.CancelledError:
                    if not self.deaf:
                        raise
        return await self.ledger.record(*args)  # type: ignore[arg-type]


@pytest.mark.parametrize("deaf", [False, True], ids=["cancellable", "ignores-cancel"])
async def test_a_stalled_ledger_write_is_tried_again(
    redis: Redis, keys: Keys, database_url: str, deaf: bool
) -> None:
    log = RedisLog(redis, keys)
    outbox = Outbox(redis, keys)
    await outbox.ensure_group()
    rid = one_per_partition(keys)[1]
    await end_in_the_log(log, rid, created())
    engine = make_engine(database_url)
    ledger = Ledger(engine)
    hangs = HangsOnce(ledger, deaf=deaf)
    recorder = Recorder(outbox, log, hangs, "rec", block_ms=50, record_timeout_s=0.5, **RECORDER)  # type: ignore[arg-type]
    running = asyncio.create_task(recorder.run())
    try:
        await eventually(lambda: ledger.get(rid), "the row, after the stalled write", timeout=30)
        assert hangs.calls == 2
        assert len(recorder._left_behind) == int(deaf)  # the deaf write still waits
    finally:
        hangs.released.set()
        recorder.stop()
        await asyncio.wait_for(running, 10)
        await engine.dispose()
