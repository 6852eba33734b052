"""The sweeper: no request hangs because its worker vanished, froze or lost track of it.

A job a worker took stays pending in the queue's consumer group under its name until
the request's terminal event is written. Every API process sweeps the pending jobs that
nobody serves: those of a worker whose heartbeat is stale (killed, frozen), and those of
a live worker that its heartbeat does not name (it lost them: a read whose reply was
lost). Such a job, once idle for ``stale_s`` (and moved to the sweeper, so that one
sweeper wins):

* never started (still ``queued``): queued again (``requeue.lua``), for another worker;
  the old entry can no longer claim it, so a frozen worker that wakes up does nothing;
* started: its ownership is taken (a new owner epoch fences the old worker out) and the
  log gets an in-band ``error`` (``worker_lost``) and the terminal ``errored`` event,
  with its outbox entry for billing. Readers see the error and the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import time

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
        now_ms = time.time() * 1000
        stale_ms = int(self.stale_s * 1000)
        for consumer in await self.queue.consumers_with_pending():
            beat = await self.heartbeats.get(consumer)
            alive = beat is not None and beat.fresh(now_ms, self.stale_s)
            served = beat.running if alive and beat is not None else frozenset()
            orphans = [
                p
                for p in await self.queue.pending(consumer)
                if p.idle_ms >= stale_ms and (p.job is None or p.job.request_id not in served)
            ]
            taken = set(
                await self.queue.take([p.entry_id for p in orphans], self.sweeper_id, stale_ms)
            )
            for p in orphans:
                if p.entry_id not in taken:
                    continue  # another sweeper took it, or the worker acted meanwhile
                if p.job is None:
                    await self.queue.ack(p.entry_id)
                elif await self.queue.requeue(p.job.request_id, p.entry_id):
                    log.warning(
                        "request %s: never started by %s; queued again", p.job.request_id, consumer
                    )
                else:
                    await self._fail(p.job.request_id, consumer)
                    await self.queue.ack(p.entry_id)
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
