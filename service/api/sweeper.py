"""The sweeper: no request hangs because its worker vanished.

A worker that is killed leaves its requests pending in the queue's consumer group
under its name, and its heartbeat goes stale. Every API process sweeps: pending
entries whose consumer has no fresh heartbeat are claimed (with a minimum idle time,
so one sweeper wins), the request's ownership is taken (a new owner epoch fences out
the old worker should it come back), and the log gets an in-band ``error``
(``worker_lost``) and the terminal ``errored`` event, with its outbox entry for
billing. Readers see the error and the stream ends.
"""

from __future__ import annotations

import asyncio
import logging

from service.store.log import LogError, RedisLog
from service.store.queue import Heartbeats, RequestQueue

log = logging.getLogger(__name__)


class Sweeper:
    def __init__(
        self,
        log_: RedisLog,
        queue: RequestQueue,
        heartbeats: Heartbeats,
        *,
        sweeper_id: str,
        stale_s: float = 5.0,
        interval_s: float = 2.0,
        hot_log_ttl_s: int = 3600,
    ) -> None:
        self.log = log_
        self.queue = queue
        self.heartbeats = heartbeats
        self.sweeper_id = sweeper_id
        self.stale_s = stale_s
        self.interval_s = interval_s
        self.hot_log_ttl_s = hot_log_ttl_s
        self.swept = 0

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
            except Exception:  # the next round tries again
                log.warning("sweep failed", exc_info=True)

    async def sweep(self) -> int:
        swept = 0
        for consumer in await self.queue.consumers_with_pending():
            if await self.heartbeats.alive(consumer, self.stale_s):
                continue
            claimed = await self.queue.claim_pending(
                consumer, self.sweeper_id, min_idle_ms=int(self.stale_s * 1000)
            )
            for entry_id, job in claimed:
                if job is not None:
                    await self._fail(job.request_id, consumer)
                await self.queue.ack(entry_id)
                swept += 1
        self.swept += swept
        return swept

    async def _fail(self, rid: str, worker: str) -> None:
        owner = await self.log.claim(rid, self.sweeper_id)
        if owner is None:  # it ended after all, or expired
            return
        message = f"the worker running this request ({worker}) stopped responding"
        try:
            await self.log.end_errored(
                rid, owner.epoch, "worker_lost", message, ttl_s=self.hot_log_ttl_s, worker_id=worker
            )
            log.warning("request %s: worker %s lost; ended errored", rid, worker)
        except LogError as exc:
            log.warning("request %s: could not end it: %s", rid, exc)
