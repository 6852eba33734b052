"""The sweeper: no request hangs because its worker vanished, froze or lost track of it.

A job a worker took stays pending in the queue's consumer group under its name until
the request's terminal event is written. Every API process sweeps the pending jobs that
nobody serves: those of a worker whose connection is gone (killed: seen within a poll
and a grace, ``store/liveness.py``), those of a worker whose heartbeat is stale (frozen,
partitioned, or killed while no sweeper could see its connection), and those of a live
worker that its heartbeat does not name (it lost them: a read whose reply was lost).
Such a job -- a gone worker's at once, the others' once idle for ``stale_s`` (moved to
the sweeper, so that one sweeper wins) -- is queued again (``requeue.lua``) behind a new
entry in the takeover queue, which is the only one that may claim it, so a frozen worker
that wakes up (or a live one whose connection was killed) does nothing:

* never started (still ``queued``): another worker simply runs it;
* started: the owner epoch is bumped (the old worker is fenced out at once) and the next
  worker continues the request from its log (a takeover: ``workers/runner.py``). A
  request whose workers were lost ``max_takeovers`` times already is ended instead: an
  in-band ``error`` (``worker_lost``) and the terminal ``errored`` event, with its
  outbox entry for billing. So is one that no worker took within its wait (the
  request's deadline, or ``takeover_wait_s``): readers see the error and the stream ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from typing import TYPE_CHECKING

from redis.asyncio import Redis

from service.api.metrics import REQUEUED, WORKER_CONNECTIONS_LOST, WORKERS_CONNECTED
from service.settings import Settings
from service.store.heartbeats import Heartbeats
from service.store.liveness import Judge, Observer
from service.store.log import LogError, RedisLog
from service.store.pool import survived
from service.store.queue import Job, RequestQueue, wait_for_takeover
from service.stream import endings
from service.stream.endings import Failure
from service.stream.lifecycle import Requeue, State

if TYPE_CHECKING:
    from service.api.context import Context

log = logging.getLogger(__name__)


# how often the connections are polled while no worker but a node's own is known (within
# the judge's 1 s of one continuous view)
QUIET_POLL_S = 0.5


class Sweeper:
    def __init__(
        self,
        log_: RedisLog,
        queue: RequestQueue,
        heartbeats: Heartbeats,
        *,
        sweeper_id: str,
        stale_s: float,
        interval_s: float,
        max_takeovers: int,
        takeover_wait_s: float,
        request_deadline_s: float,
        connections: Observer | None = None,
        connection_grace_s: float,
        connection_poll_s: float,
        own_worker: str = "",
    ) -> None:
        """The numbers are ``Settings``' (``sweeper_of``). ``own_worker``: a node's own
        worker (``lastevent node``): it dies with this process, so while no other worker is
        known the connections are polled less often."""
        self.log = log_
        self.own_worker = own_worker
        self.queue = queue
        self.heartbeats = heartbeats
        self.sweeper_id = sweeper_id
        self.stale_s = stale_s
        self.interval_s = interval_s
        self.max_takeovers = max_takeovers
        self.takeover_wait_s = takeover_wait_s  # 0: until the request's deadline
        self.request_deadline_s = request_deadline_s
        self.swept = 0
        # heartbeats are judged from then on (monotonic s): after a store outage, or a
        # heartbeat hash the store lost, a live worker's heartbeat may look stale for a
        # while (its beats could not be written, or were taken back): not before it has
        # had ``stale_s`` of a reachable store to beat again
        self._judge_from = 0.0
        self._lost_contact = False
        self._hash_lost = False
        self.connections = connections  # None: the heartbeat alone
        self.connection_poll_s = connection_poll_s
        # polls further apart than this (or than the grace) were not one continuous view
        self.judge = Judge(connection_grace_s, max(1.0, connection_grace_s))

    async def run(self) -> None:
        watching = [asyncio.create_task(self._sweeping(), name="sweep")]
        if self.connections is not None:
            watching.append(asyncio.create_task(self._watch_connections(), name="connections"))
        try:
            await asyncio.gather(*watching)
        finally:
            for task in watching:
                task.cancel()
            await asyncio.gather(*watching, return_exceptions=True)
            if self.connections is not None:
                await self.connections.close()

    async def _watch_connections(self) -> None:
        """Every ``connection_poll_s``: whose connection is gone; their jobs go at once."""
        assert self.connections is not None
        asked: list[str] = []
        # workers judged gone, not back since (when judged): a process whose connection was
        # killed but which lives (frozen) may still be handed jobs by a blocked read it
        # sent before; those are taken over too, until its heartbeat is stale
        gone: dict[str, float] = {}
        failures = 0  # in a row: logged once, and polled less often meanwhile
        while True:
            # nobody else to watch (no worker, or only a node's own): a new worker is
            # learnt within QUIET_POLL_S, not 0.1 s (one that dies before is left to its
            # heartbeat, as one that dies before its first poll always was)
            quiet = not gone and all(w == self.own_worker for w in asked)
            pause = max(self.connection_poll_s, QUIET_POLL_S) if quiet else self.connection_poll_s
            await asyncio.sleep(min(5.0, pause * 2**failures))
            try:
                known, connected = await self.connections.poll(asked)
            except Exception as exc:  # noqa: BLE001 - the view is broken: start again
                self.judge.reset()
                WORKERS_CONNECTED.set(0)
                asked = []
                failures += 1
                if failures == 1:
                    survived("watching the workers' connections", exc)
                continue
            failures = 0
            WORKERS_CONNECTED.set(len(connected))
            now = time.monotonic()
            for worker in self.judge.observe(now, asked, connected):
                WORKER_CONNECTIONS_LOST.inc()
                log.warning("worker %s: its connection is gone; taking over its jobs", worker)
                gone[worker] = now
            asked = known
            for worker, since in list(gone.items()):
                if worker in connected or now - since > self.stale_s:
                    del gone[worker]
                    continue
                try:
                    await self.take_over(worker)
                except Exception as exc:  # noqa: BLE001 - its heartbeat goes stale then
                    survived(f"taking over the jobs of {worker}", exc)

    async def _sweeping(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.sweep()
                await self.end_unclaimed()
                await self.end_parked()
            except Exception:  # the next round tries again
                log.warning("sweep failed", exc_info=True)
                self.store_lost()

    def store_lost(self) -> None:
        """The store could not be asked (an outage, a failover): the time it was away does
        not count towards a worker's staleness."""
        self._lost_contact = True

    async def _judging(self, consumers: int) -> bool:
        """Whether heartbeats may be judged now: not for ``stale_s`` after the store was
        away, nor after it lost the heartbeats of workers that still hold jobs."""
        now = time.monotonic()
        hash_lost = bool(consumers) and not await self.heartbeats.known()
        if self._lost_contact or (hash_lost and not self._hash_lost):  # (once per loss)
            self._lost_contact = False
            self._judge_from = now + self.stale_s
            log.warning(
                "the store was away or lost the heartbeats: no takeover for %gs", self.stale_s
            )
        self._hash_lost = hash_lost
        return now >= self._judge_from

    async def sweep(self) -> int:
        swept = 0
        now_ms = time.time() * 1000
        stale_ms = int(self.stale_s * 1000)
        parts = self.queue.keys.all_partitions
        pending = {p: await self.queue.consumers_with_pending(p) for p in parts}
        if not await self._judging(sum(len(c) for c in pending.values())):
            return 0
        for part in parts:
            for consumer in pending[part]:
                beat = await self.heartbeats.get(consumer)
                alive = beat is not None and beat.fresh(now_ms, self.stale_s)
                served = beat.running if alive and beat is not None else frozenset()
                how = "its heartbeat is stale" if not alive else "its heartbeat does not name it"
                swept += await self._sweep(part, consumer, stale_ms, served, how)
        self.swept += swept
        return swept

    async def take_over(self, worker: str) -> int:
        """Queue again every job of ``worker``, whose connection is gone, now."""
        swept = 0
        for part in self.queue.keys.all_partitions:
            swept += await self._sweep(part, worker, 0, frozenset(), "its connection is gone")
        self.swept += swept
        return swept

    async def _sweep(
        self, part: int, consumer: str, idle_ms: int, served: frozenset[str], how: str
    ) -> int:
        """Queue again ``consumer``'s jobs of a partition idle at least ``idle_ms`` that
        it does not serve. Of several sweepers at once, one moves each job: the one whose
        ``take`` got it (the idle time), or the one whose ``requeue`` found it current."""
        swept = 0
        orphans = [
            p
            for p in await self.queue.pending(part, consumer)
            if p.idle_ms >= idle_ms and (p.job is None or p.job.request_id not in served)
        ]
        taken = await self.queue.take(orphans, self.sweeper_id, idle_ms)
        for p in orphans:
            if (p.stream, p.entry_id) not in taken:
                continue  # another sweeper took it, or the worker acted meanwhile
            if p.job is None:
                await self.queue.ack_pending(p)
            else:
                await self._requeue(p.entry_id, p.job, consumer, how)
            swept += 1
        return swept

    async def _requeue(self, entry_id: bytes, job: Job, worker: str, how: str) -> None:
        rid = job.request_id
        done = await self.queue.requeue(
            rid,
            entry_id,
            Requeue.LOST,
            max_takeovers=self.max_takeovers,
            wait_until_ms=int(
                wait_for_takeover(job, self.takeover_wait_s, self.request_deadline_s) * 1000
            ),
        )
        if done.entry_id is not None:
            REQUEUED.labels(reason=str(Requeue.LOST)).inc()
            log.warning("request %s: its worker %s is lost (%s); queued again", rid, worker, how)
            return
        if done.exhausted is not None:
            times = done.exhausted + 1
            await self._fail(
                rid,
                worker,
                f"the worker running this request ({worker}) stopped responding; its "
                f"workers were lost {times} times (at most {self.max_takeovers} takeovers)",
            )
        # else: it ended, or waits behind another entry: this one is stale
        await self.queue.ack(rid, entry_id)

    async def end_unclaimed(self) -> int:
        """End the requests queued again for a takeover that no worker took in time."""
        ended = 0
        for rid in await self.queue.orphans_due(int(time.time() * 1000)):
            meta = await self.log.meta(rid)
            if meta is not None and meta.state == State.RUNNING and not meta.owner:
                await self._fail(
                    rid, "none", "no worker was available to continue this request in time"
                )
                ended += 1
            await self.queue.forget_orphan(rid)
        return ended

    async def end_parked(self) -> int:
        """End the parked requests whose resume window is over, nobody having come back:
        abandoned (a reader that comes back meanwhile fences this end out)."""
        ended = 0
        now_ms = int(time.time() * 1000)
        for rid in await self.queue.parked_due(now_ms):
            w = await self.log.written(rid, worker_id="none")
            if w.meta is not None and w.meta.state == State.PARKED:
                ending = endings.window_over(w.request, w.completion_tokens, w.meta.delivered)
                try:
                    await self.log.end(rid, w.meta.epoch, ending)
                    ended += 1
                except LogError as exc:  # a reader came back (or it ended) meanwhile
                    log.info("request %s: not ended at its window's end: %s", rid, exc)
            await self.queue.forget_parked(rid)
        return ended

    async def _fail(self, rid: str, worker: str, message: str) -> None:
        owner = await self.log.claim(rid, self.sweeper_id)
        if owner is None:  # it ended after all, or expired
            return
        try:
            await self.log.fail(rid, owner.epoch, Failure("worker_lost", message), worker_id=worker)
            log.warning("request %s: ended errored: %s", rid, message)
        except LogError as exc:
            log.warning("request %s: could not end it: %s", rid, exc)


def sweeper_of(settings: Settings, redis: Redis, ctx: Context) -> Sweeper:
    """Takes a lost worker's jobs over, in every known model's queues."""
    keys = ctx.log.keys
    swept = RequestQueue(redis, keys)
    ctx.catalog.follow(swept)
    return Sweeper(
        ctx.log,
        swept,
        ctx.admission.heartbeats,
        sweeper_id=f"sweeper-{uuid.uuid4().hex[:8]}",
        stale_s=settings.worker_stale_s,
        interval_s=settings.sweep_interval_s,
        max_takeovers=settings.max_takeovers,
        takeover_wait_s=settings.takeover_wait_s,
        request_deadline_s=settings.request_deadline_s,
        connections=Observer(redis, keys) if settings.worker_connection_grace_s >= 0 else None,
        connection_grace_s=settings.worker_connection_grace_s,
        connection_poll_s=settings.worker_connection_poll_s,
        own_worker=settings.worker_id,
    )
