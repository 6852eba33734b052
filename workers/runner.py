"""The worker loop: claim queued requests, generate, end each with exactly one terminal event.

Per request: take ownership (owner epoch), run it through the engine
(``generate.Generation``), count what was wasted, append the terminal event with its
outbox entry (the recorder turns that into the billing row) and the job's ack. The
presence watch (``presence.PresenceWatch``) turns cancels and departed readers into
abort decisions; a heartbeat tells the API processes this worker is alive.

A request another worker started and lost (the sweeper queued it again) or handed over
is continued from its log: the claim bumps the owner epoch past the old owner's, and the
generation resumes after the log's last delta. On SIGTERM the worker stops claiming,
lets running requests finish for ``worker_drain_s``, then hands the rest over (queues
them again for another worker, fenced by its epoch) and exits.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import logging
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from service.settings import Settings
from service.store.control import Control
from service.store.keys import Keys
from service.store.log import (
    AlreadyEnded,
    AppendBatcher,
    Fenced,
    LogError,
    LogGap,
    LogGone,
    Owner,
    Recovery,
    RedisLog,
)
from service.store.outbox import Outbox
from service.store.pool import STORE_ERRORS
from service.store.queue import Heartbeat, Heartbeats, Job, RequestQueue, wait_for_takeover
from service.stream.events import Created, Delta, End, Summary, encode_summary, summarize
from service.stream.ids import EventId
from service.stream.lifecycle import Requeue, State
from service.tokenize import ModelInfo
from workers.decide import wasted_tokens
from workers.engines.base import Engine
from workers.generate import Generation, Outcome
from workers.metrics import (
    ABORTS,
    CONTINUED,
    HANDED_OVER,
    PROMPT_TOKENS,
    QUEUE_WAIT,
    REPREFILL_TOKENS,
    REQUEST_DURATION,
    RUNNING,
    SLOTS,
    WASTED_TOKENS,
)
from workers.presence import PresenceWatch

log = logging.getLogger(__name__)

MAX_CLAIM_BURST = 64  # jobs taken in one queue read
SERVED_REMEMBERED = 10_000  # queue entries this worker ran, never to be run again by it
END_MARGIN_S = 60.0  # a request's end is retried this long past its deadline
INTERNAL = "the worker failed while serving this request"
LOG_LOST = "Redis lost part of this request's log (it restarted without all of its data)"


class Runner:
    def __init__(self, settings: Settings, redis: Redis, engine: Engine, model: ModelInfo) -> None:
        self.settings = settings
        self.engine = engine
        self.keys = keys = Keys(settings.key_prefix, settings.partitions)
        self.log = RedisLog(redis, keys)
        self.queue = RequestQueue(redis, keys)
        self.heartbeats = Heartbeats(redis, keys)
        self.outbox = Outbox(redis, keys)
        self.control = Control(redis, keys)
        self.batcher = AppendBatcher(self.log, interval_s=settings.flush_interval_ms / 1000)
        self.generation = Generation(engine, model, self.batcher, settings.request_deadline_s)
        self.running: set[str] = set()  # request ids inside the engine
        self.decisions: dict[str, State] = {}  # cancel / abandon decisions not yet applied
        self.handing_over: set[str] = set()  # stopping: these go to another worker
        self.watch = PresenceWatch(
            self.control,
            settings.worker_id,
            check_s=settings.presence_check_s,
            undecided=lambda: [r for r in self.running if r not in self.decisions],
            decide=self.decide,
        )
        self.mean_service_ms = 0.0  # moving average of claim-to-end time
        self._tasks: set[asyncio.Task[None]] = set()
        self._aborts: set[asyncio.Task[None]] = set()
        self._stopping = asyncio.Event()
        # queue entries, as (partition, entry id): two partitions' queues make the same ids
        self._served: collections.OrderedDict[tuple[int, bytes], None] = collections.OrderedDict()
        self._serving: dict[tuple[int, bytes], asyncio.Task[None]] = {}  # entry -> its task
        self.handed_over = 0  # requests this worker handed over when it stopped

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        await self.queue.ensure_group()
        self.batcher.start()
        watchers = [*self.watch.tasks(), asyncio.create_task(self._heartbeat(), name="heartbeat")]
        try:
            await self._claim_loop()
            await self._drain()
        finally:
            for task in watchers:
                task.cancel()
            await asyncio.wait(watchers, timeout=5)  # (bounded: a stopping worker exits)
            with contextlib.suppress(RedisError):
                await self.heartbeats.remove(self.settings.worker_id)
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
            except Exception:  # Redis trouble, or a job that does not decode
                jobs = []
                log.exception("queue read failed")
                # a read whose reply was lost left its jobs pending under this worker
                lost_reply = True
                await asyncio.sleep(0.5)
            # a pending re-read hands back entries this worker is serving already
            jobs = [(e, j) for e, j in jobs if (partition, e) not in self._serving][:taken]
            for _ in range(taken - len(jobs)):
                slots.release()
            for entry_id, job in jobs:
                prior = [t for t in self._tasks if t.get_name() == job.request_id]
                task = asyncio.create_task(self._serve(entry_id, job, prior), name=job.request_id)
                self._tasks.add(task)
                self._serving[partition, entry_id] = task
                task.add_done_callback(self._tasks.discard)
                task.add_done_callback(functools.partial(self._served_entry, (partition, entry_id)))
                task.add_done_callback(lambda _t: slots.release())

    def _served_entry(self, entry: tuple[int, bytes], _task: asyncio.Task[None]) -> None:
        self._serving.pop(entry, None)

    def decide(self, rid: str, state: State) -> None:
        """Cancel or abandon: abort the engine now; the generation writes the end."""
        if rid not in self.running or rid in self.decisions:
            return
        self.decisions[rid] = state
        ABORTS.labels(reason=str(state)).inc()
        task = asyncio.create_task(self.generation.abort(rid))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _heartbeat(self) -> None:
        """Tell the API processes this worker is alive, its slots, and how long requests take
        (what the 503 "queue would wait too long" estimate is made of)."""
        while True:
            stopping = self._stopping.is_set()  # still alive, but no slots for admission
            beat = Heartbeat(
                0 if stopping else self.settings.worker_concurrency,
                0 if stopping else len(self._tasks),
                int(time.time() * 1000),
                int(self.mean_service_ms),
                frozenset(t.get_name() for t in self._tasks),
            )
            SLOTS.set(beat.slots)
            RUNNING.set(len(self._tasks))
            try:
                await self.heartbeats.beat(self.settings.worker_id, beat)
            except STORE_ERRORS as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self.settings.worker_heartbeat_s)

    async def _drain(self) -> None:
        """Let running requests finish for ``worker_drain_s``; hand the rest over."""
        if self._tasks:
            _, left = await asyncio.wait(set(self._tasks), timeout=self.settings.worker_drain_s)
            if left:
                log.info("handing %d request(s) over to other workers", len(left))
                for task in left:
                    rid = task.get_name()
                    self.handing_over.add(rid)
                    ABORTS.labels(reason="handover").inc()
                    aborting = asyncio.create_task(self.generation.abort(rid))
                    self._aborts.add(aborting)
                    aborting.add_done_callback(self._aborts.discard)
                await asyncio.gather(*left, return_exceptions=True)
        if self._aborts:
            await asyncio.wait(self._aborts, timeout=5)

    async def _serve(self, entry_id: bytes, job: Job, prior: list[asyncio.Task[None]]) -> None:
        rid = job.request_id
        owner: Owner | None = None
        first: tuple[EventId, Created] | None = None
        entry = (self.keys.partition(rid), entry_id)
        if entry in self._served:
            # handed to this worker again after it served it: Redis lost the end (and the
            # ack) in a restart. Never run it twice: end it errored if its end is gone.
            await self._end_errored(entry_id, job, None, "log_lost", LOG_LOST)
            return
        self._served[entry] = None
        while len(self._served) > SERVED_REMEMBERED:
            self._served.popitem(last=False)
        if prior:
            # queued again while this worker still ran it (it was frozen past its
            # heartbeat): the old run is fenced out; let it stop before this one starts
            with contextlib.suppress(Exception):
                await self.generation.abort(rid)
            await asyncio.wait(prior)
        try:
            owner = await self.log.claim(rid, self.settings.worker_id, entry_id)
            if owner is None:  # expired, ended, or queued again (this worker was frozen)
                await self.queue.ack(self.keys.partition(rid), entry_id)
                return
            dispatched_ms = int(time.time() * 1000)
            first = owner.first
            first_run = owner.epoch <= 1
            if first_run:
                PROMPT_TOKENS.inc(len(job.prompt_token_ids))
                if first is not None:
                    QUEUE_WAIT.observe(max(0, dispatched_ms - first[0].ms) / 1000)
            logged, recovery = await self._continued(job, owner)
            self.running.add(rid)
            try:
                outcome = await self.generation.run(
                    job,
                    owner,
                    self.decisions,
                    logged=logged,
                    handing_over=self.handing_over,
                    dispatched_at=dispatched_ms / 1000 if first_run else None,
                )
            finally:
                self.running.discard(rid)
                self.decisions.pop(rid, None)
                self.watch.forget(rid)
            if outcome.error_code == "deadline":
                ABORTS.labels(reason="deadline").inc()
            if outcome.handed_over:
                await self._hand_over(entry_id, job, owner)
                return
            # the end acknowledges the queue entry, in the same step
            await self._end(job, owner, first, outcome, dispatched_ms, recovery, entry_id)
            took_ms = time.time() * 1000 - dispatched_ms
            self.mean_service_ms = (
                took_ms
                if not self.mean_service_ms
                else (0.9 * self.mean_service_ms + 0.1 * took_ms)
            )
        except Fenced:
            log.warning("request %s was taken over by another worker; stopping", rid)
        except LogGone as exc:  # Redis lost all of it: the ledger still gets its row
            log.warning("request %s: %s", rid, exc)
            await self._record_lost(job, first)
        except LogGap as exc:  # Redis lost part of the log: say so in band, and end
            log.warning("request %s: %s", rid, exc)
            await self._end_errored(entry_id, job, owner, "log_lost", LOG_LOST)
        except LogError as exc:
            log.warning("request %s: %s", rid, exc)
            await self.queue.ack(self.keys.partition(rid), entry_id)
        except Exception:
            log.exception("request %s failed in the worker", rid)
            await self._end_errored(entry_id, job, owner, "internal_error", INTERNAL)

    async def _continued(self, job: Job, owner: Owner) -> tuple[list[Delta], Recovery]:
        """A request another worker started (its epoch is past the first claim's): the
        deltas in its log, and its recovery counts with the tokens this worker prefills
        again. A first run: nothing to continue."""
        if owner.epoch <= 1:
            return [], Recovery()
        logged = [e for _, e in await self.log.read(job.request_id) if isinstance(e, Delta)]
        # each choice prefills the prompt and its own logged ids again
        reprefill = job.n * len(job.prompt_token_ids) + sum(len(d.token_ids) for d in logged)
        recovery = await self.log.resumed(owner, reprefill)
        CONTINUED.inc()
        REPREFILL_TOKENS.inc(reprefill)
        log.info(
            "request %s: continuing it after %d completion tokens (takeovers %d, handovers %d)",
            job.request_id,
            reprefill - job.n * len(job.prompt_token_ids),
            recovery.takeovers,
            recovery.handovers,
        )
        return logged, recovery

    async def _hand_over(self, entry_id: bytes, job: Job, owner: Owner) -> None:
        """Stopping: queue the request again for another worker to continue (everything
        this worker released is in the log already). If Redis cannot be reached the job
        stays pending under this worker, and the sweeper takes it over as lost."""
        try:
            done = await self.queue.requeue(
                job.request_id,
                entry_id,
                Requeue.HANDOVER,
                epoch=owner.epoch,
                wait_until_ms=int(self._wait_for_takeover(job) * 1000),
            )
        except STORE_ERRORS:
            log.exception("request %s: could not hand it over", job.request_id)
            return
        if done.entry_id is not None:
            self.handed_over += 1
            HANDED_OVER.inc()
            log.info("request %s: handed over to another worker", job.request_id)

    def _wait_for_takeover(self, job: Job) -> float:
        return wait_for_takeover(
            job, self.settings.takeover_wait_s, self.settings.request_deadline_s
        )

    async def _end(
        self,
        job: Job,
        owner: Owner,
        first: tuple[EventId, Created] | None,
        outcome: Outcome,
        dispatched_ms: int,
        recovery: Recovery,
        entry_id: bytes,
    ) -> None:
        """The terminal event, with its waste count and outbox summary, in one append that
        also acknowledges the queue entry ``entry_id``."""
        rid = job.request_id
        end = outcome.events[-1]
        assert isinstance(end, End)
        end.takeovers = recovery.takeovers
        end.handovers = recovery.handovers
        end.reprefill_tokens = recovery.reprefill_tokens
        delivered: int | None = None
        if end.state == State.ABANDONED:
            # nobody came back within the grace period: what no reader got was wasted. Any
            # other end is in the log for the hot TTL, for a client between connections
            # to read (it is billed as delivered; a later reader gets it all)
            try:
                delivery = await self.control.delivery(rid)
                delivered = None if delivery.present else delivery.delivered
            except STORE_ERRORS:
                pass  # count only what came after the abort decision
        end.wasted_tokens = wasted_tokens(end.completion_tokens, outcome.covered_tokens, delivered)
        WASTED_TOKENS.inc(end.wasted_tokens)
        summary = self._summary(rid, first, end, outcome, dispatched_ms)
        await self.batcher.append(
            owner,
            outcome.events,
            terminal_state=end.state,
            ttl_s=self._ttl(first),
            summary=encode_summary(summary),
            give_up_at=self._give_up_at(job),
            inflight_key=""
            if first is None
            else self.keys.inflight_of(first[1].tenant, first[1].api_key_id),
            ack=entry_id,
        )
        REQUEST_DURATION.labels(state=end.state).observe(
            max(0.0, time.time() - dispatched_ms / 1000)
        )

    async def _record_lost(self, job: Job, first: tuple[EventId, Created] | None) -> None:
        """Redis lost the request (a restart without persistence): no terminal event can be
        written, but the ledger gets an ``errored`` row through an outbox entry of its own
        (the queue entry went with the rest, so there is nothing to ack)."""
        now_ms = int(time.time() * 1000)
        end = End(str(State.ERRORED), None, len(job.prompt_token_ids), 0)
        summary = summarize(
            job.request_id,
            first,
            end,
            now_ms=now_ms,
            error_code="log_lost",
            worker_id=self.settings.worker_id,
        )
        try:
            await self.outbox.add(summary, f"{now_ms}-0")
        except STORE_ERRORS:
            log.exception("request %s: could not record it as lost", job.request_id)

    def _ttl(self, first: tuple[EventId, Created] | None) -> int:
        """How long the finished log stays in Redis (``store: false``: briefly)."""
        if first is not None and not first[1].store:
            return min(self.settings.unstored_ttl_s, self.settings.hot_log_ttl_s)
        return self.settings.hot_log_ttl_s

    def _give_up_at(self, job: Job) -> float:
        """How long the worker keeps trying to end a request through a Redis outage: past
        its deadline by a margin, so that a deadline ending can still be written."""
        deadline = job.deadline_unix_s or time.time() + self.settings.request_deadline_s
        return deadline + END_MARGIN_S

    async def _end_errored(
        self, entry_id: bytes, job: Job, owner: Owner | None, code: str, message: str
    ) -> None:
        """End the request ``errored`` with an in-band error instead of leaving its readers
        waiting until the safety TTL: a bug, Redis failing mid-request, or a log Redis lost
        part of. Tries until Redis answers, up to ``_give_up_at``; then the request is left
        to the sweeper and its TTL."""
        rid = job.request_id
        with contextlib.suppress(Exception):
            await self.generation.abort(rid)
        backoff = 0.1
        while True:
            try:
                if owner is None:  # it failed before (or while) taking ownership
                    owner = await self.log.claim(rid, self.settings.worker_id, entry_id)
                    if owner is None:  # ended or expired meanwhile
                        await self.queue.ack(self.keys.partition(rid), entry_id)
                        return
                await self.log.end_errored(
                    rid,
                    owner.epoch,
                    code,
                    message,
                    ttl_s=self.settings.hot_log_ttl_s,
                    worker_id=self.settings.worker_id,
                    prompt_tokens=len(job.prompt_token_ids),
                )
                await self.queue.ack(self.keys.partition(rid), entry_id)
                return
            except (Fenced, AlreadyEnded):
                with contextlib.suppress(RedisError):
                    await self.queue.ack(self.keys.partition(rid), entry_id)
                return
            except Exception:
                if time.time() > self._give_up_at(job):
                    log.exception("giving up ending request %s", rid)
                    return
                log.warning("could not end request %s yet (retrying)", rid, exc_info=True)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)

    def _summary(
        self,
        rid: str,
        first: tuple[EventId, Created] | None,
        end: End,
        outcome: Outcome,
        dispatched_ms: int,
    ) -> Summary:
        first_token_ms = None
        if outcome.first_token_at is not None:
            first_token_ms = int(outcome.first_token_at * 1000)
        return summarize(
            rid,
            first,
            end,
            now_ms=dispatched_ms,
            dispatched_ms=dispatched_ms,
            first_token_ms=first_token_ms,
            error_code=outcome.error_code,
            worker_id=self.settings.worker_id,
        )
