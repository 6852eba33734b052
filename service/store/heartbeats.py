"""The workers' heartbeats (``keys.workers``): what each worker tells the API processes
about itself once a second -- its slots, how busy, how long requests take, the requests
it serves and the models it serves."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgspec
from redis.asyncio import Redis

from service.store import replies
from service.store.keys import Keys, model_lane


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat:
    """What a worker tells the API processes about itself, once a second (keys.workers)."""

    slots: int
    busy: int
    unix_ms: int
    mean_service_ms: int
    running: frozenset[str] = frozenset()  # the request ids it serves (the sweeper looks)
    models: tuple[str, ...] = ()  # the names it serves: its base model, then its adapters

    def encode(self) -> bytes:
        return _beat_enc.encode(
            _Beat(
                self.slots,
                self.busy,
                self.unix_ms,
                self.mean_service_ms,
                sorted(self.running),
                list(self.models),
            )
        )

    @classmethod
    def decode(cls, raw: bytes | str) -> Heartbeat:
        data = raw.encode() if isinstance(raw, str) else raw
        if data.startswith(b"["):
            b = _beat_dec.decode(data)
            running = frozenset(b.running)
            return cls(b.slots, b.busy, b.unix_ms, b.mean_service_ms, running, tuple(b.models))
        # an earlier version's: "<slots> <busy> <unix ms> <mean ms> [id,id,...]"
        parts = replies.text(data).split()
        slots, busy, unix_ms, mean = (int(float(x)) for x in parts[:4])
        running = frozenset(parts[4].split(",")) if len(parts) > 4 else frozenset()
        return cls(slots, busy, unix_ms, mean, running)

    def serves(self, model: str) -> bool:
        return model in self.models

    def fresh(self, now_ms: float, stale_s: float) -> bool:
        return now_ms - self.unix_ms <= stale_s * 1000


class _Beat(msgspec.Struct, array_like=True):
    slots: int
    busy: int
    unix_ms: int
    mean_service_ms: int
    running: list[str]
    models: list[str]


_beat_enc = msgspec.json.Encoder()
_beat_dec = msgspec.json.Decoder(_Beat)


class Heartbeats:
    """The ``workers`` hash: worker id -> its latest ``Heartbeat``."""

    def __init__(self, redis: Redis, keys: Keys) -> None:
        self.redis = redis
        self.keys = keys

    async def beat(self, worker_id: str, beat: Heartbeat) -> None:
        await self.redis.hset(self.keys.workers, worker_id, beat.encode())

    async def remove(self, worker_id: str) -> None:
        await self.redis.hdel(self.keys.workers, worker_id)

    async def known(self) -> int:
        """How many workers have a heartbeat (0 after a store lost the hash)."""
        return int(await self.redis.hlen(self.keys.workers))

    async def get(self, worker_id: str) -> Heartbeat | None:
        raw = await self.redis.hget(self.keys.workers, worker_id)
        return None if raw is None else Heartbeat.decode(raw)

    async def alive(self, worker_id: str, stale_s: float) -> bool:
        beat = await self.get(worker_id)
        return beat is not None and beat.fresh(time.time() * 1000, stale_s)

    async def live(self, stale_s: float) -> list[Heartbeat]:
        """The fresh heartbeats."""
        return _fresh(await self.redis.hgetall(self.keys.workers), stale_s)

    async def live_with_depth(self, stale_s: float, model: str) -> tuple[list[Heartbeat], int]:
        """The fresh heartbeats and the length of ``model``'s queues, in one round trip
        (admission)."""
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.keys.workers)
        for p in self.keys.all_partitions:
            for stream in self.keys.queues(p, model_lane(model)):
                pipe.xlen(stream)
        beats, *depths = await pipe.execute()
        return _fresh(beats, stale_s), sum(replies.integer(d) for d in depths)


def _fresh(beats: dict[Any, Any], stale_s: float) -> list[Heartbeat]:
    """The fresh ones of the ``workers`` hash's heartbeats (worker id -> encoded)."""
    now_ms = time.time() * 1000
    return [b for b in map(Heartbeat.decode, beats.values()) if b.fresh(now_ms, stale_s)]
