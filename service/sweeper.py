"""The sweeper: no request hangs because its worker vanished.

A worker that is killed leaves its requests pending in the queue's consumer group
under its name, and its heartbeat goes stale. Every API process (and every worker)
sweeps: pending entries whose consumer has no fresh heartbeat are claimed
(``XCLAIM`` with a minimum idle time, so one sweeper wins), the request's ownership
is taken (a new owner epoch fences out the old worker should it come back), and the
log gets an in-band ``error`` (``worker_lost``) and the terminal ``errored`` event,
with its outbox entry for billing. Readers see the error and the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from service.keys import JOB_FIELD, QUEUE_GROUP, Keys
from service.queue import Heartbeat, RequestQueue, decode_job
from service.redis_log import LogError, RedisLog

log = logging.getLogger(__name__)


class Sweeper:
    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        *,
        sweeper_id: str,
        stale_s: float = 5.0,
        interval_s: float = 2.0,
        hot_log_ttl_s: int = 3600,
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.sweeper_id = sweeper_id
        self.stale_s = stale_s
        self.interval_s = interval_s
        self.hot_log_ttl_s = hot_log_ttl_s
        self.log = RedisLog(redis, keys)
        self.queue = RequestQueue(redis, keys)
        self.swept = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
            except Exception as exc:  # the next round tries again
                log.warning("sweep failed: %s", exc)

    async def sweep(self) -> int:
        try:
            consumers = await self.redis.xinfo_consumers(self.keys.queue, QUEUE_GROUP)
        except ResponseError as exc:  # no queue or group yet: no worker ever started
            if "no such key" in str(exc).lower() or "NOGROUP" in str(exc):
                return 0
            raise
        dead = [c["name"] for c in consumers if c["pending"] and not await self._alive(c["name"])]
        swept = 0
        for consumer in dead:
            name = consumer.decode() if isinstance(consumer, bytes) else consumer
            pending = await self.redis.xpending_range(
                self.keys.queue, QUEUE_GROUP, min="-", max="+", count=100, consumername=name
            )
            ids = [p["message_id"] for p in pending]
            if not ids:
                continue
            claimed = await self.redis.xclaim(
                self.keys.queue, QUEUE_GROUP, self.sweeper_id,
                min_idle_time=int(self.stale_s * 1000), message_ids=ids,
            )
            for entry_id, fields in claimed:
                if fields:
                    await self._fail(decode_job(fields[JOB_FIELD]).request_id, name)
                await self.queue.ack(entry_id)
                swept += 1
        self.swept += swept
        return swept

    async def _alive(self, worker: bytes | str) -> bool:
        raw = await self.redis.hget(self.keys.workers, worker)
        return raw is not None and Heartbeat.decode(raw).fresh(time.time() * 1000, self.stale_s)

    async def _fail(self, rid: str, worker: str) -> None:
        epoch = await self.log.claim(rid, self.sweeper_id)
        if epoch is None:  # it ended after all, or expired
            return
        message = f"the worker running this request ({worker}) stopped responding"
        try:
            await self.log.end_errored(rid, epoch, "worker_lost", message,
                                       ttl_s=self.hot_log_ttl_s, worker_id=worker)
            log.warning("request %s: worker %s lost; ended errored", rid, worker)
        except LogError as exc:
            log.warning("request %s: could not end it: %s", rid, exc)
