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
import logging
import time

from redis.asyncio import Redis

from service.control import ABANDONED, CANCELLED, Control
from service.db.ledger import Ledger
from service.keys import Keys
from service.queue import Heartbeat, Job, RequestQueue
from service.redis_log import AlreadyEnded, AppendBatcher, Fenced, LogError, RedisLog
from service.settings import Settings
from service.stream.assemble import Assembler
from service.stream.events import (
    Created,
    End,
    Event,
    FinishReason,
    State,
    Summary,
    encode_summary,
    summarize,
)
from service.stream.ids import EventId
from service.tokenize import ModelInfo
from workers.engines.base import Engine, EngineError, SamplingParams
from workers.metrics import ABORTS, WASTED_TOKENS

log = logging.getLogger(__name__)


@dataclasses.dataclass(slots=True)
class _Outcome:
    events: list[Event]
    first_token_at: float | None
    error_code: str | None = None
    covered_tokens: int | None = None  # tokens made before an abort decision (None: no abort)


_DECIDED = {CANCELLED: State.CANCELLED, ABANDONED: State.ABANDONED}


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
        self.control = Control(redis, keys)
        self.batcher = AppendBatcher(self.log)
        self.redis = redis
        self.keys = keys
        self.running: set[str] = set()  # request ids inside the engine
        self.decisions: dict[str, State] = {}  # cancel / abandon decisions not yet applied
        self._timers: dict[str, asyncio.TimerHandle] = {}  # grace periods running out
        self.mean_service_ms = 0.0  # moving average of claim-to-end time
        self._tasks: set[asyncio.Task[None]] = set()
        self._background: set[asyncio.Task[None]] = set()  # ledger writes
        self._stopping = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()

    async def run(self) -> None:
        await self.queue.ensure_group()
        self.batcher.start()
        watchers = [
            asyncio.create_task(self._watch_presence(), name="presence-check"),
            asyncio.create_task(self._listen_control(), name="control"),
            asyncio.create_task(self._heartbeat(), name="heartbeat"),
        ]
        slots = asyncio.Semaphore(self.settings.worker_concurrency)
        try:
            while not self._stopping.is_set():
                await slots.acquire()
                taken = 1
                while taken < 64 and not slots.locked():  # claim a burst in one read
                    await slots.acquire()
                    taken += 1
                try:
                    jobs = await self.queue.read(self.settings.worker_id, count=taken, block_ms=500)
                except Exception:
                    jobs = []
                    log.exception("queue read failed")
                    await asyncio.sleep(0.5)
                for _ in range(taken - len(jobs)):
                    slots.release()
                if not jobs:
                    continue
                for entry_id, job in jobs:
                    task = asyncio.create_task(self._serve(entry_id, job), name=job.request_id)
                    self._tasks.add(task)
                    task.add_done_callback(self._tasks.discard)
                    task.add_done_callback(lambda _t: slots.release())
            await self._drain()
        finally:
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            with contextlib.suppress(Exception):
                await self.redis.hdel(self.keys.workers, self.settings.worker_id)
            await self.batcher.close()

    def decide(self, rid: str, state: State) -> None:
        """Cancel or abandon: abort the engine now; ``_generate`` writes the end."""
        if rid not in self.running or rid in self.decisions:
            return
        self.decisions[rid] = state
        ABORTS.labels(reason=str(state)).inc()
        task = asyncio.create_task(self.engine.abort(rid))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _watch_presence(self) -> None:
        """Every ``presence_check_s``: one round trip asks about all running requests."""
        while True:
            await asyncio.sleep(self.settings.presence_check_s)
            rids = [r for r in self.running if r not in self.decisions]
            try:
                verdicts = await self.control.check(rids)
            except Exception as exc:
                log.warning("presence check failed: %s", exc)
                continue
            for rid, verdict in verdicts.items():
                self._act_on(rid, verdict)

    def _act_on(self, rid: str, verdict: int) -> None:
        if verdict in _DECIDED:
            self.decide(rid, _DECIDED[verdict])
        elif verdict < 0 and rid not in self._timers:
            # no reader: look again exactly when the grace period runs out
            loop = asyncio.get_running_loop()
            self._timers[rid] = loop.call_later(-verdict / 1000, self._recheck, rid)

    def _recheck(self, rid: str) -> None:
        self._timers.pop(rid, None)
        if rid in self.running and rid not in self.decisions:
            task = asyncio.create_task(self._check_one(rid))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _check_one(self, rid: str) -> None:
        try:
            verdict = (await self.control.check([rid])).get(rid, 0)
        except Exception as exc:
            log.warning("presence check of %s failed: %s", rid, exc)
            return
        self._act_on(rid, verdict)

    async def _listen_control(self) -> None:
        """Cancels (and nudges) published to this worker's channel, acted on at once."""
        channel = self.keys.control(self.settings.worker_id)
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(channel)
                async for message in pubsub.listen():
                    verb, _, rid = message["data"].decode().partition(":")
                    if verb == "cancel":
                        self.decide(rid, State.CANCELLED)
                    elif verb == "check" and rid in self.running:
                        await self._check_one(rid)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # reconnect; the periodic check covers the gap
                log.warning("control channel failed (resubscribing): %s", exc)
                await asyncio.sleep(0.5)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    async def _heartbeat(self) -> None:
        """Tell the API processes this worker is alive, its slots, and how long requests take
        (what the 503 "queue would wait too long" estimate is made of)."""
        while True:
            if not self._stopping.is_set():
                beat = Heartbeat(self.settings.worker_concurrency, len(self._tasks),
                                 int(time.time() * 1000), int(self.mean_service_ms))
                try:
                    await self.redis.hset(
                        self.keys.workers, self.settings.worker_id, beat.encode()
                    )
                except Exception as exc:
                    log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(1.0)

    async def _drain(self) -> None:
        """Let running requests finish (bounded by their deadlines)."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._background:  # give pending ledger writes a moment
            await asyncio.wait(self._background, timeout=5)

    async def _serve(self, entry_id: bytes, job: Job) -> None:
        rid = job.request_id
        epoch: int | None = None
        try:
            epoch = await self.log.claim(rid, self.settings.worker_id)
            if epoch is None:  # expired or already ended: nothing to do
                await self.queue.ack(entry_id)
                return
            dispatched_ms = int(time.time() * 1000)
            first = await self.log.first_with_id(rid)
            self.running.add(rid)
            try:
                outcome = await self._generate(job, epoch)
            finally:
                self.running.discard(rid)
                self.decisions.pop(rid, None)
                timer = self._timers.pop(rid, None)
                if timer is not None:
                    timer.cancel()
            end = outcome.events[-1]
            assert isinstance(end, End)
            end.wasted_tokens = await self._wasted(rid, end, outcome)
            WASTED_TOKENS.inc(end.wasted_tokens)
            summary = self._summary(rid, first, end, outcome, dispatched_ms)
            await self.batcher.append(
                rid,
                epoch,
                outcome.events,
                terminal_state=end.state,
                ttl_s=self.settings.hot_log_ttl_s,
                summary=encode_summary(summary),
            )
            await self.queue.ack(entry_id)
            took_ms = time.time() * 1000 - dispatched_ms
            self.mean_service_ms = took_ms if not self.mean_service_ms else (
                0.9 * self.mean_service_ms + 0.1 * took_ms
            )
        except Fenced:
            log.warning("request %s was taken over by another worker; stopping", rid)
        except LogError as exc:
            log.warning("request %s: %s", rid, exc)
            await self.queue.ack(entry_id)
        except Exception:
            log.exception("request %s failed in the worker", rid)
            await self._end_after_crash(entry_id, job, epoch)

    async def _end_after_crash(self, entry_id: bytes, job: Job, epoch: int | None) -> None:
        """A bug, or Redis failing mid-request: end it ``errored`` (``internal_error``)
        instead of leaving its readers waiting until the safety TTL. Best effort: a few
        tries, then the request is left to its deadline and TTL."""
        rid = job.request_id
        with contextlib.suppress(Exception):
            await self.engine.abort(rid)
        for attempt in range(3):
            try:
                if epoch is None:  # it failed before (or while) taking ownership
                    epoch = await self.log.claim(rid, self.settings.worker_id)
                    if epoch is None:  # ended or expired meanwhile
                        await self.queue.ack(entry_id)
                        return
                await self.log.end_errored(
                    rid, epoch, "internal_error", "the worker failed while serving this request",
                    ttl_s=self.settings.hot_log_ttl_s, worker_id=self.settings.worker_id,
                    prompt_tokens=len(job.prompt_token_ids),
                )
                await self.queue.ack(entry_id)
                return
            except (Fenced, AlreadyEnded):
                await self.queue.ack(entry_id)
                return
            except Exception as exc:
                log.warning("could not end request %s after a failure (try %d): %s",
                            rid, attempt + 1, exc)
                await asyncio.sleep(0.5 * 2**attempt)

    def _summary(
        self,
        rid: str,
        first: tuple[EventId, Created] | None,
        end: End,
        outcome: _Outcome,
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

    async def _wasted(self, rid: str, end: End, outcome: _Outcome) -> int:
        """Tokens generated that no reader got: after an abort decision, and -- when no
        reader is left -- everything past what the last reader was sent."""
        covered = end.completion_tokens if outcome.covered_tokens is None else outcome.covered_tokens
        try:
            pipe = self.redis.pipeline(transaction=False)
            pipe.hget(self.keys.meta(rid), "delivered")
            pipe.zcount(self.keys.readers(rid), int(time.time() * 1000), "+inf")
            delivered_raw, present = await pipe.execute()
        except Exception:
            return end.completion_tokens - covered
        if not present:
            covered = min(covered, int(delivered_raw or 0))
        return max(0, end.completion_tokens - covered)

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
        covered: int | None = None
        budget = job.deadline_unix_s - time.time() if job.deadline_unix_s else None
        reason: str | None = None
        try:
            async with asyncio.timeout(budget):
                gen = self.engine.generate(rid, job.prompt_token_ids, params)
                async with contextlib.aclosing(gen):  # type: ignore[type-var]
                    async for out in gen:
                        if out.token_ids and first_token_at is None:
                            first_token_at = time.time()
                        if rid in self.decisions:  # decided: count what the engine still made
                            covered = asm.completion_tokens if covered is None else covered
                            asm.completion_tokens += len(out.token_ids)
                            if out.finished:
                                break
                            continue
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
        decided = self.decisions.get(rid)
        if decided is not None:
            covered = asm.completion_tokens if covered is None else covered
            reason_for = {State.CANCELLED: FinishReason.CANCELLED, State.ABANDONED: FinishReason.ABANDONED}
            events = asm.finish(decided, reason_for[decided])
            return _Outcome(events, first_token_at, covered_tokens=covered)
        if reason == "abort":  # the engine aborted on its own (e.g. shutting down)
            return _Outcome(asm.fail("engine_aborted", "the engine aborted the request"), first_token_at, "engine_aborted")
        return _Outcome(asm.finish(State.FINISHED, reason), first_token_at)
