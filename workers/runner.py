"""The worker loop: claim queued requests, run the engine, append events.

Per request: take ownership (owner epoch), feed each engine step's token ids to
the pure ``Assembler`` (detokenizer + holdback), append what it returns through
the ``AppendBatcher`` (one pipelined round trip for all requests' steps), end
with exactly one terminal event, ack the job, then record the billing row.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import logging
import time

from redis.asyncio import Redis

from service.db.ledger import Ledger, Record
from service.keys import Keys
from service.queue import Job, RequestQueue
from service.redis_log import AppendBatcher, Fenced, LogError, RedisLog
from service.settings import Settings
from service.stream.assemble import Assembler
from service.stream.events import Created, End, Event, State
from service.stream.ids import EventId
from service.tokenize import ModelInfo
from workers.engines.base import Engine, EngineError, SamplingParams

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Outcome:
    events: list[Event]
    first_token_at: float | None
    error_code: str | None = None


class Runner:
    def __init__(
        self,
        settings: Settings,
        redis: Redis,
        engine: Engine,
        model: ModelInfo,
        ledger: Ledger | None,
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.model = model
        self.ledger = ledger
        keys = Keys(settings.key_prefix)
        self.log = RedisLog(redis, keys)
        self.queue = RequestQueue(redis, keys)
        self.batcher = AppendBatcher(self.log)
        self._tasks: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()  # ledger writes
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        await self.queue.ensure_group()
        self.batcher.start()
        slots = asyncio.Semaphore(self.settings.worker_concurrency)
        try:
            while not self._stopping.is_set():
                await slots.acquire()
                try:
                    jobs = await self.queue.read(self.settings.worker_id, count=1, block_ms=500)
                except Exception:
                    slots.release()
                    log.exception("queue read failed")
                    await asyncio.sleep(0.5)
                    continue
                if not jobs:
                    slots.release()
                    continue
                for entry_id, job in jobs:
                    task = asyncio.create_task(self._serve(entry_id, job), name=job.request_id)
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    task.add_done_callback(lambda _t: slots.release())
            await self._drain()
        finally:
            await self.batcher.close()

    async def _drain(self) -> None:
        """Let running requests finish (bounded by their deadlines)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._background:  # give pending ledger writes a moment
            await asyncio.wait(self._background, timeout=5)

    async def _serve(self, entry_id: bytes, job: Job) -> None:
        rid = job.request_id
        try:
            epoch = await self.log.claim(rid, self.settings.worker_id)
            if epoch is None:  # expired or already ended: nothing to do
                await self.queue.ack(entry_id)
                return
            created = await self.log.first(rid)
            outcome = await self._generate(job, epoch)
            end = outcome.events[-1]
            assert isinstance(end, End)
            ids = await self.batcher.append(
                rid,
                epoch,
                outcome.events,
                terminal_state=end.state,
                ttl_s=self.settings.hot_log_ttl_s,
            )
            await self.queue.ack(entry_id)
        except Fenced:
            log.warning("request %s was taken over by another worker; stopping", rid)
            return
        except LogError as exc:
            log.warning("request %s: %s", rid, exc)
            await self.queue.ack(entry_id)
            return
        except Exception:
            log.exception("request %s failed in the worker", rid)
            return
        if created is not None and self.ledger is not None:
            rec = self._record(rid, created, end, ids[-1], outcome)
            task = asyncio.create_task(self._record_with_retry(rec))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _generate(self, job: Job, epoch: int) -> _Outcome:
        rid = job.request_id
        asm = Assembler(
            self.model.tokenizer,
            prompt_tokens=len(job.prompt_token_ids),
            stop=job.stop,
            stop_token_ids=self.model.eos_token_ids,
        )
        params = SamplingParams(
            max_tokens=job.max_tokens,
            temperature=job.temperature,
            top_p=job.top_p,
            seed=job.seed,
            stop_token_ids=self.model.eos_token_ids,
        )
        first_token_at: float | None = None
        budget = job.deadline_unix_s - time.time() if job.deadline_unix_s else None
        reason: str | None = None
        try:
            async with asyncio.timeout(budget):
                gen = self.engine.generate(rid, job.prompt_token_ids, params)
                async with contextlib.aclosing(gen):  # type: ignore[type-var]
                    async for out in gen:
                        if out.token_ids and first_token_at is None:
                            first_token_at = time.time()
                        step = asm.step(out.token_ids)
                        if step.events:
                            await self.batcher.append(rid, epoch, step.events)
                        if step.stopped:  # a stop string completed: free the engine now
                            await self.engine.abort(rid)
                            break
                        if out.finished:
                            reason = out.finish_reason
                            break
        except TimeoutError:
            await self.engine.abort(rid)
            msg = f"request exceeded its deadline of {self.settings.request_deadline_s:g} s"
            return _Outcome(asm.fail("deadline_exceeded", msg), first_token_at, "deadline")
        except EngineError as exc:
            return _Outcome(asm.fail(exc.code, str(exc)), first_token_at, exc.code)
        if reason == "abort":
            events = asm.finish(State.CANCELLED, "cancelled")
        else:
            events = asm.finish(State.FINISHED, reason)
        return _Outcome(events, first_token_at)

    def _record(
        self, rid: str, created: Created, end: End, end_id: EventId, outcome: _Outcome
    ) -> Record:
        def ts(seconds: float) -> dt.datetime:
            return dt.datetime.fromtimestamp(seconds, tz=dt.UTC)

        return Record(
            id=rid,
            kind=created.kind,
            model=created.model,
            created_at=ts(created.created),
            first_token_at=None if outcome.first_token_at is None else ts(outcome.first_token_at),
            ended_at=ts(end_id.ms / 1000),
            state=end.state,
            finish_reason=end.finish_reason,
            prompt_tokens=end.prompt_tokens,
            completion_tokens=end.completion_tokens,
            error_code=outcome.error_code,
            worker_id=self.settings.worker_id,
            last_event_id=str(end_id),
        )

    async def _record_with_retry(self, rec: Record) -> None:
        assert self.ledger is not None
        delay = 0.5
        for _attempt in range(12):
            try:
                await self.ledger.record(rec)
                return
            except Exception as exc:
                log.warning("ledger write for %s failed (retrying): %s", rec.id, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
        log.error("ledger write for %s gave up; the row is missing", rec.id)
