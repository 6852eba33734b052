"""The request queue: a Redis Stream read by the consumer group ``workers``.

The API enqueues a ``Job`` after it created the request's log. A worker acks
the job only after the request's terminal event is in the log, so a job whose
worker died stays pending and can be claimed by another worker.
"""

from __future__ import annotations

import dataclasses

import msgspec
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from service.keys import JOB_FIELD, QUEUE_GROUP, Keys


class Job(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = []
    deadline_unix_s: float = 0.0  # 0: none


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat:
    """What a worker tells the API processes about itself, once a second (keys.workers)."""

    slots: int
    busy: int
    unix_ms: int
    mean_service_ms: int

    def encode(self) -> str:
        return f"{self.slots} {self.busy} {self.unix_ms} {self.mean_service_ms}"

    @classmethod
    def decode(cls, raw: bytes | str) -> Heartbeat:
        slots, busy, unix_ms, mean = (int(float(x)) for x in raw.split())
        return cls(slots, busy, unix_ms, mean)

    def fresh(self, now_ms: float, stale_s: float) -> bool:
        return now_ms - self.unix_ms <= stale_s * 1000


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(Job)


def decode_job(data: bytes) -> Job:
    return _dec.decode(data)


def encode_job(job: Job) -> bytes:
    """The queue entry's payload (field ``JOB_FIELD``; ``create.lua`` writes it too)."""
    return _enc.encode(job)


class RequestQueue:
    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def ensure_group(self) -> None:
        try:
            await self.redis.xgroup_create(self.keys.queue, QUEUE_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def enqueue(self, job: Job) -> bytes:
        return await self.redis.xadd(self.keys.queue, {JOB_FIELD: encode_job(job)})

    async def read(self, consumer: str, count: int, block_ms: int) -> list[tuple[bytes, Job]]:
        reply = await self.redis.xreadgroup(
            QUEUE_GROUP, consumer, {self.keys.queue: ">"}, count=count, block=block_ms
        )
        out: list[tuple[bytes, Job]] = []
        for _key, entries in reply or []:
            for entry_id, fields in entries:
                out.append((entry_id, _dec.decode(fields[JOB_FIELD])))
        return out

    async def ack(self, entry_id: bytes) -> None:
        pipe = self.redis.pipeline(transaction=False)
        pipe.xack(self.keys.queue, QUEUE_GROUP, entry_id)
        pipe.xdel(self.keys.queue, entry_id)
        await pipe.execute()

    async def depth(self) -> int:
        return int(await self.redis.xlen(self.keys.queue))
