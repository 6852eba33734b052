"""The worker loop: claim queued requests, serve each to exactly one terminal event.

Per partition, a claim loop takes jobs as the worker's slots allow and serves each one
as a task of its own (``serve.Serve``: ownership, generation, the ending). The presence
watch (``owner_watch.OwnerWatch``) turns cancels and departed readers into decisions,
which ``decide`` hands to the request as a signal and acts on at once (the engine
aborts); a heartbeat tells the API processes this worker is alive.

On SIGTERM the worker stops claiming, lets running requests finish for
``worker_drain_s``, then hands the rest over (queues them again for another worker,
fenced by its epoch) and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from service.settings import Settings
from service.store import commit
from service.store.batcher import AppendBatcher
from service.store.heartbeats import Heartbeat, Heartbeats
from service.store.keys import Keys, model_lane
from service.store.liveness import Announcer
from service.store.local import LocalFeed
from service.store.log import RedisLog, Retention
from service.store.owner import OwnerChannel
from service.store.pool import survived
from service.store.queue import Job, RequestQueue
from service.store.readers import Readers
from service.store.registry import ModelRegistry, parse_lora_modules
from service.stream.lifecycle import State
from service.tokenize import ModelInfo
from workers.engines.base import Engine
from workers.generate import Generation
from workers.metrics import ABORTS, RUNNING, SLOTS
from workers.owner_watch import OwnerWatch
from workers.serve import Serve

log = logging.getLogger(__name__)

MAX_CLAIM_BURST = 64  # jobs taken in one queue read


class Runner:
    def __init__(
        self,
        settings: Settings,
        redis: Redis,
        engine: Engine,
        model: ModelInfo,
        feed: LocalFeed | None = None,
    ) -> None:
        """``feed``: a node's readers in this process (``store/local.py``), fed from the
        appends of the requests it runs."""
        self.settings = settings
        self.engine = engine
        self.keys = keys = Keys(settings.key_prefix, settings.partitions)
        self.log = RedisLog(redis, keys, Retention.of(settings), commit.of(settings, redis, keys))
        # the names it serves: its model, then its adapters; it reads their lanes (and the
        # plain queues of ids without a lane, an earlier version's)
        self.models = (settings.model_name, *parse_lora_modules(settings.lora_modules))
        self.registry = ModelRegistry(redis, keys)
        self.queue = RequestQueue(redis, keys, ["", *(model_lane(m) for m in self.models)])
        self.heartbeats = Heartbeats(redis, keys)
        self.owner = OwnerChannel(redis, keys)
        self.readers = Readers(redis, keys)
        # held while this process lives: the API processes see it go the moment it dies
        self.announcer = Announcer(
            redis, keys, settings.worker_id, self._beat, silent_s=settings.redis_silent_s
        )
        self.batcher = AppendBatcher(
            self.log, interval_s=settings.flush_interval_ms / 1000, feed=feed
        )
        self.generation = Generation(engine, model, self.batcher, settings.request_deadline_s)
        self.watch = OwnerWatch(
            self.owner,
            settings.worker_id,
            check_s=settings.presence_check_s,
            # (an engine that cannot continue a request keeps it running for its window)
            park_after_s=settings.park_after_s if engine.continues else -1,
            silent_s=settings.redis_silent_s,
            undecided=lambda: [r for r, s in self.serve.running.items() if s.decided is None],
            decide=self.decide,
        )
        self.serve = Serve(
            settings,
            self.log,
            self.queue,
            self.readers,
            self.batcher,
            self.generation,
            self.watch.forget,
        )
        self._tasks: set[asyncio.Task[None]] = set()
        # engine aborts and jobs given back: the drain waits for them
        self._background: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        # (queue, entry) -> its task
        self._serving: dict[tuple[str, bytes], asyncio.Task[None]] = {}

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        await self.queue.ensure_group()
        try:
            await self.registry.declare(
                self.models[0],
                list(self.models[1:]),
                engine=self.engine.name,
                images=self.engine.images,
            )
        except ValueError as exc:
            raise SystemExit(str(exc)) from None
        self.batcher.start()
        watchers = [*self.watch.tasks(), asyncio.create_task(self._heartbeat(), name="heartbeat")]
        named = asyncio.create_task(self.announcer.run(), name="named-connection")
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            for task in watchers:
                task.cancel()
            await asyncio.wait(watchers, timeout=5)  # (bounded: a stopping worker exits)
            with contextlib.suppress(RedisError):
                await self.heartbeats.remove(self.settings.worker_id)
            # the named connection goes last: a worker without a heartbeat is not watched,
            # so a clean stop is not taken for a death
            named.cancel()
            await asyncio.wait([named], timeout=5)
            await self.batcher.close()

    async def _claim_loop(self) -> None:
        """One claim loop per partition, all taking from the worker's slots (with more
        partitions than slots, a partition whose loop waits for a slot is read when a
        loop holding one times out: within ``block_ms``)."""
        slots = asyncio.Semaphore(self.settings.worker_concurrency)
        await asyncio.gather(*(self._claim(p, slots) for p in self.keys.all_partitions))

    async def _claim(self, partition: int, slots: asyncio.Semaphore) -> None:
        lost_reply = True  # at start: jobs a previous run under this id left pending
        while not self._stopping.is_set():
            if not self.engine.available:  # (an upstream that refuses connections)
                await asyncio.sleep(0.2)
                continue
            await slots.acquire()
            taken = 1
            while taken < MAX_CLAIM_BURST and not slots.locked():  # a burst in one read
                await slots.acquire()
                taken += 1
            try:
                jobs = await self.queue.read(
                    partition,
                    self.settings.worker_id,
                    count=taken,
                    block_ms=500,
                    pending=lost_reply,
                )
                lost_reply = False
            except Exception as exc:  # noqa: BLE001 - Redis trouble, or a job that does not decode
                jobs = []
                survived("a queue read", exc)
                # a read whose reply was lost left its jobs pending under this worker
                lost_reply = True
                await asyncio.sleep(0.5)
            # a pending re-read hands back entries this worker is serving already
            jobs = [
                (e, j)
                for e, j in jobs
                if (self.keys.queue_of(j.request_id), e) not in self._serving
            ]
            # both queues had jobs: the takeover queue's come first; fresh ones past the
            # slots taken go back, to the front (the takeover queue), for any worker
            jobs, extra = jobs[:taken], jobs[taken:]
            if extra:
                self._give_back(extra)
            for _ in range(taken - len(jobs)):
                slots.release()
            for entry_id, job in jobs:
                prior = [t for t in self._tasks if t.get_name() == job.request_id]
                task = asyncio.create_task(self.serve(entry_id, job, prior), name=job.request_id)
                self._tasks.add(task)
                at = (self.keys.queue_of(job.request_id), entry_id)
                self._serving[at] = task
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(functools.partial(self._served_entry, at))
                task.add_done_callback(lambda _t: slots.release())

    def _give_back(self, jobs: list[tuple[bytes, Job]]) -> None:
        async def give_back() -> None:
            try:
                await self.queue.give_back(jobs)
            except Exception as exc:  # noqa: BLE001 - left pending: the sweeper's
                survived("giving jobs back", exc)

        task = asyncio.create_task(give_back())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def _served_entry(self, entry: tuple[str, bytes], _task: asyncio.Task[None]) -> None:
        self._serving.pop(entry, None)

    def decide(self, rid: str, state: State) -> None:
        """Cancel, abandon or park: the request's signal, and the engine aborts now; the
        generation stops it at its next step."""
        signals = self.serve.running.get(rid)
        if signals is None or signals.decided is not None:
            return
        signals.decided = state
        ABORTS.labels(reason=str(state)).inc()
        self._abort(rid)

    def _abort(self, rid: str) -> None:
        task = asyncio.create_task(self.generation.abort(rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _heartbeat(self) -> None:
        """Tell the API processes this worker is alive, its slots, and how long requests take
        (what the 503 "queue would wait too long" estimate is made of)."""
        while True:
            try:
                await self._beat()
            except Exception as exc:  # noqa: BLE001 - a silent worker gets taken over
                survived("a heartbeat", exc)
            await asyncio.sleep(self.settings.worker_heartbeat_s)

    async def _beat(self) -> None:
        # still alive, but no slots for admission: stopping, or its upstream is down
        stopping = self._stopping.is_set() or not self.engine.available
        beat = Heartbeat(
            0 if stopping else self.settings.worker_concurrency,
            0 if stopping else len(self._tasks),
            int(time.time() * 1000),
            int(self.serve.mean_service_ms),
            frozenset(t.get_name() for t in self._tasks),
            self.models,
        )
        SLOTS.labels(model=self.models[0]).set(beat.slots)
        RUNNING.labels(model=self.models[0]).set(len(self._tasks))
        await self.heartbeats.beat(self.settings.worker_id, beat)

    async def _drain(self) -> None:
        """Let running requests finish for ``worker_drain_s``; hand the rest over."""
        if self._tasks:
            _, left = await asyncio.wait(set(self._tasks), timeout=self.settings.worker_drain_s)
            if left:
                log.info("handing %d request(s) over to other workers", len(left))
                self.serve.handing_over = True  # (and those not in the engine yet)
                for signals in self.serve.running.values():
                    signals.handing_over = True
                for task in left:
                    ABORTS.labels(reason="handover").inc()
                    self._abort(task.get_name())
                await asyncio.gather(*left, return_exceptions=True)
        if self._background:
            await asyncio.wait(self._background, timeout=5)
