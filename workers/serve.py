"""One queued job, from its claim to its ending -- exactly one terminal event.

Take ownership (the owner epoch), continue what another worker started (takeover,
handover), run it through the engine (``generate.Generation``), turn how its choices
stopped into its ending (``service/stream/endings.py``) and write that with its outbox
entry and the queue entry's ack, in one step (``AppendBatcher.end``). A request this
worker cannot finish -- a bug, a log Redis lost part of -- is ended ``errored`` in
band; one Redis lost whole still gets its billing row; one another worker took over is
left to it; one the worker hands over (it is stopping) is queued again.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Callable

import msgspec
from redis.exceptions import RedisError

from service.settings import Settings
from service.store.admission import Slot, free_slots
from service.store.batcher import AppendBatcher
from service.store.log import AlreadyEnded, Fenced, LogError, LogGap, LogGone, Owner, RedisLog
from service.store.outbox import Outbox
from service.store.pool import STORE_ERRORS, UNREACHABLE, Backoff
from service.store.queue import Job, RequestQueue, wait_for_takeover
from service.store.readers import Readers
from service.stream import endings
from service.stream.endings import Failure, FencedOut, HandOver, Park, Recovery
from service.stream.events import Delta
from service.stream.lifecycle import Requeue
from workers.decide import Signals, how_claimed
from workers.generate import Generation
from workers.metrics import (
    ABORTS,
    CONTINUED,
    HANDED_OVER,
    PARK_RESUME,
    PARKS,
    PROMPT_TOKENS,
    QUEUE_WAIT,
    REPREFILL_TOKENS,
    REQUEST_DURATION,
    WASTED_TOKENS,
    FirstToken,
)

log = logging.getLogger(__name__)

SERVED_REMEMBERED = 10_000  # queue entries this worker ran, never to be run again by it
END_MARGIN_S = 60.0  # a request's end is retried this long past its deadline


class Serve:
    """Serves jobs (``__call__``: one job, as its own task). ``running``: the control
    signals of the requests in the engine (the runner sets them); ``forget``: a request
    left the engine."""

    def __init__(
        self,
        settings: Settings,
        log_: RedisLog,
        queue: RequestQueue,
        readers: Readers,
        batcher: AppendBatcher,
        generation: Generation,
        forget: Callable[[str], None],
    ) -> None:
        self.settings = settings
        self.log = log_
        self.queue = queue
        self.readers = readers
        self.outbox = Outbox(log_.redis, log_.keys)
        self.batcher = batcher
        self.generation = generation
        self.running: dict[str, Signals] = {}
        self.handing_over = False  # stopping: every running request goes to another worker
        self._forget = forget
        # queue entries, as (queue, entry id): two queues make the same ids
        self._served: collections.OrderedDict[tuple[str, bytes], None] = collections.OrderedDict()
        self.mean_service_ms = 0.0  # moving average of claim-to-end time

    async def __call__(self, entry_id: bytes, job: Job, prior: list[asyncio.Task[None]]) -> None:
        rid = job.request_id
        part = self.log.keys.queue_of(rid)
        if (part, entry_id) in self._served:
            # handed to this worker again after it served it: Redis lost the end (and the
            # ack) in a restart. Never run it twice: end it errored if its end is gone.
            await self._fail(entry_id, job, None, endings.LOG_GAP)
            return
        self._served[part, entry_id] = None
        while len(self._served) > SERVED_REMEMBERED:
            self._served.popitem(last=False)
        if prior:
            # queued again while this worker still ran it (it was frozen past its
            # heartbeat): the old run is fenced out; let it stop before this one starts
            with contextlib.suppress(Exception):
                await self.generation.abort(rid)
            await asyncio.wait(prior)
        backoff = Backoff(0.1, 0.5)  # (a failover is followed within its longest wait)
        # Redis away (a restart, a failover) under a step the batcher does not retry (the
        # claim, a continuation's read): the job is served again -- claimed again by this
        # worker, continued from its log -- once Redis answers, until its deadline
        while not await self._serve_once(entry_id, job):
            await backoff.wait()

    async def _serve_once(self, entry_id: bytes, job: Job) -> bool:
        """One try at ``job``: False if Redis could not be reached and it is to be tried
        again (before its deadline)."""
        rid = job.request_id
        owner: Owner | None = None
        try:
            owner = await self.log.claim(rid, self.settings.worker_id, entry_id)
            if owner is None:  # expired, ended, or queued again (this worker was frozen)
                await self.queue.ack(rid, entry_id)
                return True
            if self.batcher.feed is not None:  # a node: its readers of rid fed from memory
                self.batcher.feed.own(rid)
            await self._run(entry_id, job, owner)
        except UNREACHABLE as exc:
            if not job.deadline_unix_s or time.time() < job.deadline_unix_s:
                log.warning("request %s: Redis unreachable (%s); serving it again", rid, exc)
                return False
            log.exception("request %s: Redis unreachable past its deadline", rid)
            await self._fail(entry_id, job, owner, endings.INTERNAL)
        except Fenced:
            log.warning("request %s was taken over by another worker; stopping", rid)
        except LogGone as exc:  # Redis lost all of it: the ledger still gets its row
            log.warning("request %s: %s", rid, exc)
            await self._record_lost(job, owner)
        except LogGap as exc:  # Redis lost part of the log: say so in band, and end
            log.warning("request %s: %s", rid, exc)
            await self._fail(entry_id, job, owner, endings.LOG_GAP)
        except LogError as exc:
            log.warning("request %s: %s", rid, exc)
            await self.queue.ack(rid, entry_id)
        except Exception:
            log.exception("request %s failed in the worker", rid)
            await self._fail(entry_id, job, owner, endings.INTERNAL)
        finally:
            if self.batcher.feed is not None:
                self.batcher.feed.release(rid)
        return True

    async def _run(self, entry_id: bytes, job: Job, owner: Owner) -> None:
        rid = job.request_id
        model = job.model or self.settings.model_name
        dispatched_ms = int(time.time() * 1000)
        first_run = owner.epoch <= 1
        if first_run:
            PROMPT_TOKENS.labels(model=model).inc(len(job.prompt_token_ids))
            if owner.first is not None:
                QUEUE_WAIT.labels(model=model).observe(
                    max(0, dispatched_ms - owner.first[0].ms) / 1000
                )
        logged, recovery = await self._continued(job, owner)
        if recovery.paused_ms and job.deadline_unix_s:  # time parked does not count
            job = msgspec.structs.replace(
                job, deadline_unix_s=job.deadline_unix_s + recovery.paused_ms / 1000
            )
        first_token = FirstToken(dispatched_ms / 1000 if first_run else None, model)
        self.running[rid] = signals = Signals(handing_over=self.handing_over)
        try:
            mark = (self.settings.worker_id, how_claimed(first_run, logged, recovery))
            stopped = await self.generation.run(
                job, owner, signals, first_token, logged=logged, mark=mark
            )
        finally:
            del self.running[rid]
            self._forget(rid)
            prompt_tokens = self.generation.prompt_tokens.pop(rid, len(job.prompt_token_ids))
        request = endings.Request(
            rid,
            owner.first,
            prompt_tokens,
            dispatched_ms,
            recovery,
            self.settings.worker_id,
            dispatched_ms,
            None if first_token.at is None else int(first_token.at * 1000),
        )
        if recovery.returned_ms and first_token.at is not None:  # a reader came back to it
            PARK_RESUME.observe(max(0.0, first_token.at - recovery.returned_ms / 1000))
        delivered = await self._delivered(rid) if endings.wants_delivery(stopped) else None
        ending = endings.ran(request, stopped, delivered=delivered)
        if isinstance(ending, FencedOut):
            raise Fenced(f"request {rid}: owner epoch {owner.epoch} was fenced out")
        if isinstance(ending, HandOver):
            await self._hand_over(entry_id, job, owner, ending)
            return
        if isinstance(ending, Park):
            await self._park(entry_id, job, owner, ending)
            return
        if ending.summary.error_code == endings.DEADLINE:
            ABORTS.labels(reason="deadline").inc()
        WASTED_TOKENS.inc(ending.end.wasted_tokens)
        await self.batcher.end(owner, ending, ack=entry_id, give_up_at=self._give_up_at(job))
        took_ms = time.time() * 1000 - dispatched_ms
        REQUEST_DURATION.labels(state=ending.state, model=model).observe(took_ms / 1000)
        self.mean_service_ms = (
            took_ms if not self.mean_service_ms else 0.9 * self.mean_service_ms + 0.1 * took_ms
        )

    async def _delivered(self, rid: str) -> int | None:
        """The most completion tokens a reader got, if none is there now (None: one is, or
        Redis cannot say: then only what came after the abort decision is wasted)."""
        try:
            delivery = await self.readers.delivery(rid)
        except STORE_ERRORS:
            return None
        return None if delivery.present else delivery.delivered

    async def _continued(self, job: Job, owner: Owner) -> tuple[list[Delta], Recovery]:
        """A request another worker started (its epoch is past the first claim's), or this
        one before Redis went away under it (its log holds more than ``created``): the
        deltas in its log, and its recovery counts with the tokens this worker prefills
        again. A first run: nothing to continue."""
        if owner.epoch <= 1 and owner.events <= 1:
            return [], Recovery()
        logged = [e for _, e in await self.log.read(job.request_id) if isinstance(e, Delta)]
        # each choice prefills the prompt and its own logged ids again
        prompts = job.n * len(job.prompt_token_ids)
        reprefill = prompts + sum(len(d.token_ids) for d in logged)
        recovery = await self.log.resumed(owner, reprefill)
        CONTINUED.inc()
        REPREFILL_TOKENS.inc(reprefill)
        log.info(
            "request %s: continuing it after %d completion tokens (takeovers %d, handovers %d)",
            job.request_id,
            reprefill - prompts,
            recovery.takeovers,
            recovery.handovers,
        )
        return logged, recovery

    async def _hand_over(self, entry_id: bytes, job: Job, owner: Owner, hand: HandOver) -> None:
        """Stopping: queue the request again for another worker to continue (everything
        this worker released is in the log: finished choices' last deltas go now). If
        Redis cannot be reached the job stays pending under this worker, and the sweeper
        takes it over as lost."""
        if hand.tail:
            await self.batcher.append(owner, hand.tail, give_up_at=job.deadline_unix_s)
        until_s = wait_for_takeover(
            job, self.settings.takeover_wait_s, self.settings.request_deadline_s
        )
        try:
            done = await self.queue.requeue(
                job.request_id,
                entry_id,
                Requeue.HANDOVER,
                epoch=owner.epoch,
                wait_until_ms=int(until_s * 1000),
            )
        except STORE_ERRORS:
            log.exception("request %s: could not hand it over", job.request_id)
            return
        if done.entry_id is not None:
            HANDED_OVER.inc()
            log.info("request %s: handed over to another worker", job.request_id)

    async def _park(self, entry_id: bytes, job: Job, owner: Owner, park: Park) -> None:
        """No reader is left: out of the engine (done), its log and job kept, its admission
        slot freed; a reader that comes back makes it go on (``lease_and_unpark.lua``) -- at once if
        one came back meanwhile (``park.lua``). Raises ``Fenced``."""
        if park.tail:
            await self.batcher.append(owner, park.tail, give_up_at=job.deadline_unix_s)
        parked = await self.log.park(owner, entry_id, park.discarded_tokens)
        if parked.window_ms is None:
            log.info("request %s: its reader came back as it was parked; going on", job.request_id)
            return
        PARKS.inc()
        log.info("request %s: parked (no reader left)", job.request_id)
        if owner.first is not None:  # a parked request holds no slot of its key's
            created = owner.first[1]
            slot = Slot.of(self.log.keys, job.request_id, created.tenant, created.api_key_id)
            await free_slots(self.log.redis, [slot])

    async def _record_lost(self, job: Job, owner: Owner | None) -> None:
        """Redis lost the request (a restart without persistence): no terminal event can be
        written, but the ledger gets an ``errored`` row through an outbox entry of its own
        (the queue entry went with the rest, so there is nothing to ack)."""
        now_ms = int(time.time() * 1000)
        request = endings.Request(
            job.request_id,
            owner.first if owner is not None else None,
            len(job.prompt_token_ids),
            now_ms,
            worker_id=self.settings.worker_id,
        )
        try:
            await self.outbox.add(endings.lost(request).summary, f"{now_ms}-0")
        except STORE_ERRORS:
            log.exception("request %s: could not record it as lost", job.request_id)

    def _give_up_at(self, job: Job) -> float:
        """How long the worker keeps trying to end a request through a Redis outage: past
        its deadline by a margin, so that a deadline ending can still be written."""
        deadline = job.deadline_unix_s or time.time() + self.settings.request_deadline_s
        return deadline + END_MARGIN_S

    async def _fail(self, entry_id: bytes, job: Job, owner: Owner | None, failure: Failure) -> None:
        """End the request ``errored`` with an in-band error instead of leaving its readers
        waiting until the safety TTL: a bug, Redis failing mid-request, or a log Redis lost
        part of. Tries until Redis answers, up to ``_give_up_at``; then the request is left
        to the sweeper and its TTL."""
        rid = job.request_id
        with contextlib.suppress(Exception):
            await self.generation.abort(rid)
        backoff = Backoff(0.1, 2.0)
        while True:
            try:
                if owner is None:  # it failed before (or while) taking ownership
                    owner = await self.log.claim(rid, self.settings.worker_id, entry_id)
                    if owner is None:  # ended or expired meanwhile
                        await self.queue.ack(rid, entry_id)
                        return
                await self.log.fail(
                    rid,
                    owner.epoch,
                    failure,
                    worker_id=self.settings.worker_id,
                    prompt_tokens=len(job.prompt_token_ids),
                    ack=entry_id,
                )
                return
            except (Fenced, AlreadyEnded):
                with contextlib.suppress(RedisError):
                    await self.queue.ack(rid, entry_id)
                return
            except Exception:
                if time.time() > self._give_up_at(job):
                    log.exception("giving up ending request %s", rid)
                    return
                log.warning("could not end request %s yet (retrying)", rid, exc_info=True)
                await backoff.wait()
