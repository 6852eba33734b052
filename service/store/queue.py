"""The request queues (Redis Streams read by the consumer group ``workers``), one per
partition and model (``keys.py``; the heartbeats are ``heartbeats.py``).

The API enqueues a ``Job`` together with the request's log (``create.lua``). A worker
acks the job only after the request's terminal event is in the log, so a job whose
worker died stays pending under that worker's name, where the sweeper finds it.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable
from typing import Any

import msgspec
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from service.store import groups, replies
from service.store.keys import (
    JOB_FIELD,
    QUEUE_GROUP,
    TAKEOVER_ENTRY,
    TAKEOVERS_SUFFIX,
    Keys,
)
from service.store.scripts.requeue import Requeued, RequeueScript
from service.stream.lifecycle import Requeue
from service.stream.params import SamplingParams
from service.stream.tools import ToolFormat


class Job(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    deadline_unix_s: float = 0.0  # 0: none
    n: int = 1  # choices, each its own engine request (choice i's seed: seed + i)
    tools: ToolFormat | None = None  # how tool calls are parsed out of the output
    model: str = ""  # the model the request asked for (a base model, or an adapter)
    # for a model served by a text-mode upstream: the conversation as JSON, {"messages":
    # [...]} or {"prompt": "..."}, which that upstream is sent instead of the prompt's ids
    conversation: bytes = b""
    # the prompt's images (a model whose worker declared it sees), in the order of their
    # placeholders in the prompt: each one's bytes (PNG, JPEG, GIF or WebP), checked by the API
    images: tuple[bytes, ...] = ()


def wait_for_takeover(job: Job, wait_s: float, default_deadline_s: float) -> float:
    """Until when (unix s) a started request queued again waits for a worker to continue
    it: its deadline, or ``wait_s`` from now if that is sooner (0: no such bound)."""
    now = time.time()
    deadline = job.deadline_unix_s or now + default_deadline_s
    return min(deadline, now + wait_s) if wait_s > 0 else deadline


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Job)


def decode_job(data: bytes) -> Job:
    return _dec.decode(data)


def encode_job(job: Job) -> bytes:
    """The queue entry's payload (field ``JOB_FIELD``; ``create.lua`` writes it)."""
    return _enc.encode(job)


@dataclasses.dataclass(frozen=True, slots=True)
class Pending:
    entry_id: bytes
    idle_ms: int
    job: Job | None
    stream: str  # the queue it is in


class RequestQueue:
    """The partitions' queues of some lanes (models): a job goes to its request's
    partition and lane; a worker reads each partition's queues of the lanes it serves
    (``read``), the sweeper looks at every lane's (``lanes``, which its owner keeps up to
    date). An entry is found again from its request id (which names its queue)."""

    def __init__(self, redis: Redis, keys: Keys, lanes: Iterable[str] = ("",)) -> None:
        self.redis = redis
        self.keys = keys
        self.lanes = tuple(lanes)
        self._requeue = RequeueScript(redis, keys)

    async def ensure_group(self) -> None:
        for p in self.keys.all_partitions:
            for stream in self.streams(p):
                await groups.ensure(self.redis, stream, QUEUE_GROUP)

    def streams(self, partition: int) -> list[str]:
        """A partition's takeover queues and its queues of every lane, in the order workers
        read them (every takeover queue before any fresh work)."""
        pairs = [self.keys.queues(partition, lane) for lane in self.lanes]
        return [t for t, _ in pairs] + [q for _, q in pairs]

    def _located(self, request_id: str, entry_id: bytes) -> tuple[str, bytes]:
        """The stream a request's entry is in, and its id there."""
        if entry_id.startswith(TAKEOVER_ENTRY):
            return self.keys.takeovers_of(request_id), entry_id[len(TAKEOVER_ENTRY) :]
        return self.keys.queue_of(request_id), entry_id

    def _named(self, stream: str, entry_id: Any) -> bytes:
        raw = entry_id if isinstance(entry_id, bytes) else replies.text(entry_id).encode()
        return TAKEOVER_ENTRY + raw if stream.endswith(TAKEOVERS_SUFFIX) else raw

    async def enqueue(self, job: Job) -> bytes:
        """A job on its own (the API's jobs go in with their log, in ``create.lua``)."""
        entry_id: Any = await self.redis.xadd(
            self.keys.queue_of(job.request_id), {JOB_FIELD: encode_job(job)}
        )
        return bytes(entry_id)

    async def read(
        self, partition: int, consumer: str, count: int, block_ms: int, *, pending: bool = False
    ) -> list[tuple[bytes, Job]]:
        """New jobs of one partition for ``consumer`` (waiting up to ``block_ms``), the
        takeover queue's first, or with ``pending`` the ones it was handed before and never
        acked (a reply lost to a connection failure). ``count`` bounds each queue's share:
        up to twice as many may come back. A group Redis lost (restarted without its data)
        is made again."""
        found = await groups.read(
            self.redis,
            list(self.streams(partition)),
            QUEUE_GROUP,
            consumer,
            pending=pending,
            count=count,
            block_ms=block_ms,
        )
        by_stream = {replies.text(stream): entries for stream, entries in found}
        return [
            (self._named(stream, eid), _dec.decode(fields[JOB_FIELD]))
            for stream in self.streams(partition)
            for eid, fields in by_stream.get(stream, ())
            if fields  # a pending entry trimmed meanwhile has no fields
        ]

    async def ack(self, request_id: str, entry_id: bytes) -> None:
        await self.ack_in(*self._located(request_id, entry_id))

    async def ack_pending(self, pending: Pending) -> None:
        await self.ack_in(pending.stream, pending.entry_id.removeprefix(TAKEOVER_ENTRY))

    async def ack_in(self, queue: str, raw: bytes) -> None:
        """Acknowledge and delete an entry of a stream (by its id there)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(queue, QUEUE_GROUP, raw)
        pipe.xdel(queue, raw)
        await pipe.execute()

    async def depth(self) -> int:
        """Jobs queued in all partitions (both queues of every lane)."""
        pipe = self.redis.pipeline(transaction=False)
        for p in self.keys.all_partitions:
            for stream in self.streams(p):
                pipe.xlen(stream)
        return sum(replies.integer(n) for n in await pipe.execute())

    # -- what the sweeper needs: jobs pending under a consumer --------------------------

    async def consumers_with_pending(self, partition: int) -> list[str]:
        """Consumers of a partition's group (either queue) that hold unacked jobs ([]
        before any worker started)."""
        names: dict[str, None] = {}
        for stream in self.streams(partition):
            try:
                consumers = await self.redis.xinfo_consumers(stream, QUEUE_GROUP)
            except ResponseError as exc:
                if _no_queue(exc):
                    continue
                raise
            names.update((replies.text(c["name"]), None) for c in consumers if c["pending"])
        return list(names)

    async def pending(self, partition: int, consumer: str, count: int = 100) -> list[Pending]:
        """``consumer``'s unacked jobs in a partition (either queue): entry, how long since
        it was handed them, the job (``None`` if the entry is gone)."""
        out = []
        for stream in self.streams(partition):
            try:
                raw: Any = await self.redis.xpending_range(
                    stream, QUEUE_GROUP, min="-", max="+", count=count, consumername=consumer
                )
            except ResponseError as exc:
                if _no_queue(exc):
                    continue
                raise
            if not raw:
                continue
            pipe = self.redis.pipeline(transaction=False)
            for p in raw:
                pipe.xrange(stream, min=p["message_id"], max=p["message_id"])
            found: Any = await pipe.execute()
            for p, entries in zip(raw, found, strict=True):
                fields = entries[0][1] if entries else None
                job = decode_job(fields[JOB_FIELD]) if fields else None
                entry = self._named(stream, p["message_id"])
                out.append(Pending(entry, int(p["time_since_delivered"]), job, stream))
        return out

    async def take(
        self, pending: list[Pending], claimant: str, min_idle_ms: int
    ) -> set[tuple[str, bytes]]:
        """Move pending entries to ``claimant`` (only those idle at least ``min_idle_ms``,
        so that of several sweepers one wins); returns the ones it got, as (stream,
        entry)."""
        by_stream: dict[str, list[bytes]] = {}
        for p in pending:
            raw = p.entry_id.removeprefix(TAKEOVER_ENTRY)
            by_stream.setdefault(p.stream, []).append(raw)
        got = set()
        for stream, ids in by_stream.items():
            claimed: Any = await self.redis.xclaim(
                stream,
                QUEUE_GROUP,
                claimant,
                min_idle_time=min_idle_ms,
                message_ids=list[Any](ids),
                justid=True,
            )
            got |= {(stream, self._named(stream, c)) for c in claimed}
        return got

    async def requeue(
        self,
        request_id: str,
        entry_id: bytes,
        why: Requeue = Requeue.LOST,
        *,
        max_takeovers: int = 0,
        epoch: int | None = None,
        wait_until_ms: int = 0,
    ) -> Requeued:
        """Queue a job again behind a new entry: one taken but never started, or a started
        one for another worker to continue (``why``: its worker was lost, or hands it over
        with its ``epoch``). ``wait_until_ms``: when the sweeper stops waiting for a worker
        to take a started one (``orphans``). ``max_takeovers``: how many losses a request
        may have been through before it is no longer queued again (``exhausted``)."""
        return await self._requeue(
            request_id,
            entry_id,
            why,
            max_takeovers=max_takeovers,
            epoch=epoch,
            wait_until_ms=wait_until_ms,
        )

    async def give_back(self, jobs: list[tuple[bytes, Job]]) -> None:
        """Fresh jobs a read handed this consumer beyond its free slots: queued again in
        the takeover queue (ahead of fresh work, for any worker); one that ended meanwhile
        (a cancel) is acknowledged instead."""
        for entry_id, job in jobs:
            done = await self.requeue(job.request_id, entry_id, Requeue.LOST)
            if done.entry_id is None:
                await self.ack(job.request_id, entry_id)

    async def orphans_due(self, now_ms: int, count: int = 100) -> list[str]:
        """Started requests queued again whose wait for a worker is over (all partitions)."""
        return await self._due(self.keys.orphans, now_ms, count)

    async def forget_orphan(self, request_id: str) -> None:
        await self.redis.zrem(self.keys.orphans_of(request_id), request_id)

    async def parked_due(self, now_ms: int, count: int = 100) -> list[str]:
        """Parked requests whose resume window is over (all partitions)."""
        return await self._due(self.keys.parked, now_ms, count)

    async def forget_parked(self, request_id: str) -> None:
        await self.redis.zrem(self.keys.parked_of(request_id), request_id)

    async def _due(self, key: Callable[[int], str], now_ms: int, count: int) -> list[str]:
        pipe = self.redis.pipeline(transaction=False)
        for p in self.keys.all_partitions:
            pipe.zrangebyscore(key(p), "-inf", now_ms, start=0, num=count)
        found: Any = await pipe.execute()
        return [replies.text(r) for raw in found for r in raw]


def _no_queue(exc: ResponseError) -> bool:
    """A lane nobody ever served (no stream or group yet) has nothing pending."""
    return "no such key" in str(exc).lower() or "NOGROUP" in str(exc)
