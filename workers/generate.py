"""One request through the engine: token ids in, log events out.

Each engine step's new ids go through the pure ``Assembler`` (detokenizer + stop-string
holdback); what it releases is appended through the ``AppendBatcher`` (one script call
per flush for all of the worker's requests). The terminal event is *not* written
here: ``Outcome.events`` ends with it, and the runner appends it with the outbox entry.

A request another worker started (a takeover or a handover) is continued from the
deltas in its log: the assembler is rebuilt from them (``Assembler.resume``) and the
engine prefills the prompt and their ids, and makes the rest. A request the worker is
handing over (it is stopping) ends with no terminal event at all (``handed_over``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import time
from collections.abc import Callable, Container, Mapping, Sequence

import msgspec

from service.store.log import AppendBatcher, Owner
from service.store.queue import Job
from service.stream.assemble import Assembler, ResumeMismatch, StepResult
from service.stream.events import Delta, End, Error, Event
from service.stream.lifecycle import ABORT_REASON, FinishReason, State
from service.stream.logprobs import TokenText
from service.stream.params import SamplingParams
from service.stream.tools import parser_for
from service.tokenize import ModelInfo
from workers.engines.base import Engine, EngineError
from workers.metrics import FirstToken, Steps


@dataclasses.dataclass(slots=True)
class Outcome:
    events: list[Event]  # the last one is the terminal End
    first_token_at: float | None
    error_code: str | None = None
    covered_tokens: int | None = None  # tokens made before an abort decision (None: no abort)
    handed_over: bool = False  # stopped for another worker to continue: no terminal event


def engine_id(request_id: str, index: int) -> str:
    """The engine's request id of choice ``index`` (choice 0's is the request's)."""
    return request_id if index == 0 else f"{request_id}/{index}"


def choice_params(params: SamplingParams, index: int) -> SamplingParams:
    """Choice ``index``'s sampling: a seeded request's choices are different samples,
    each reproducible (seed + index, as an int64)."""
    if index == 0 or params.seed is None:
        return params
    seed = (params.seed + index + 2**63) % 2**64 - 2**63
    return msgspec.structs.replace(params, seed=seed)


def call_ids(request_id: str, index: int) -> Callable[[int], str]:
    """Tool-call ids derived from the request: a worker that continues the request makes
    the same ids for the calls it parses again."""

    def make(call: int) -> str:
        digest = hashlib.sha256(f"{request_id}/{index}/{call}".encode()).hexdigest()
        return f"call_{digest[:24]}"

    return make


class Generation:
    def __init__(
        self, engine: Engine, model: ModelInfo, batcher: AppendBatcher, deadline_s: float
    ) -> None:
        self.engine = engine
        self.model = model
        self.batcher = batcher
        self.deadline_s = deadline_s
        self._token_text = TokenText(model.tokenizer)
        self._choices: dict[str, int] = {}  # running request -> its choices

    async def abort(self, request_id: str) -> None:
        """Abort every choice of a request in the engine."""
        for index in range(self._choices.get(request_id, 1)):
            await self.engine.abort(engine_id(request_id, index))

    async def run(
        self,
        job: Job,
        owner: Owner,
        decisions: Mapping[str, State],
        *,
        logged: Sequence[Delta] = (),
        handing_over: Container[str] = (),
        dispatched_at: float | None = None,
    ) -> Outcome:
        """Generate until the engine finishes, a stop string completes, the deadline
        passes, or ``decisions`` gets this request (cancel / abandon: the caller has
        asked the engine to abort, and the tokens it still makes are counted), or
        ``handing_over`` does (the engine was aborted; another worker continues).
        ``logged``: the deltas of a request another worker started. Each of the
        ``job.n`` choices is an engine request of its own; one End closes them all.
        ``dispatched_at``: a first run's claim (unix s), for its time to first token."""
        rid = job.request_id
        n = max(job.n, 1)
        self._choices[rid] = n
        first_token = FirstToken(dispatched_at)
        try:
            outcomes = await asyncio.gather(
                *(
                    self._choice(
                        job,
                        i,
                        owner,
                        decisions,
                        [d for d in logged if d.index == i],
                        handing_over,
                        first_token,
                    )
                    for i in range(n)
                )
            )
        finally:
            self._choices.pop(rid, None)
        if n == 1:
            return outcomes[0]
        return await self._merged(job, owner, outcomes)

    async def _merged(self, job: Job, owner: Owner, outcomes: Sequence[Outcome]) -> Outcome:
        """The choices' outcomes as the request's: their last deltas, then one End."""
        ends: list[End] = []
        for o in outcomes:
            last = o.events[-1] if o.events else None
            assert o.handed_over or isinstance(last, End)
            if isinstance(last, End):
                ends.append(last)
        starts = [o.first_token_at for o in outcomes if o.first_token_at is not None]
        first_token_at = min(starts) if starts else None
        if any(o.handed_over for o in outcomes):
            # the finished choices' last deltas go in the log now: the worker that
            # continues the request sees them ended
            done = [e for o in outcomes if not o.handed_over for e in o.events[:-1]]
            if done:
                await self.batcher.append(owner, done, give_up_at=job.deadline_unix_s)
            return Outcome([], first_token_at, handed_over=True)
        total = sum(e.completion_tokens for e in ends)
        prompt = len(job.prompt_token_ids)
        failed = [o for o in outcomes if o.error_code is not None]
        if failed:  # the engine's own error first, not a sibling's abort that it caused
            first = min(failed, key=lambda o: o.error_code == "engine_aborted")
            error = [e for e in first.events if isinstance(e, Error)][:1]
            end = End(
                state=str(State.ERRORED),
                finish_reason=None,
                prompt_tokens=prompt,
                completion_tokens=total,
            )
            return Outcome([*error, end], first_token_at, first.error_code)
        deltas = [e for o in outcomes for e in o.events[:-1]]
        states = {e.state for e in ends}
        state = next(iter(states)) if len(states) == 1 else str(State.FINISHED)
        covered = None
        if any(o.covered_tokens is not None for o in outcomes):
            covered = sum(
                o.covered_tokens if o.covered_tokens is not None else e.completion_tokens
                for o, e in zip(outcomes, ends, strict=True)
            )
        reasons = [e.finish_reason for e in ends]
        end = End(
            state=state,
            finish_reason=reasons[0],
            prompt_tokens=prompt,
            completion_tokens=total,
            finish_reasons=reasons,
        )
        return Outcome([*deltas, end], first_token_at, covered_tokens=covered)

    def _assembler(
        self, job: Job, index: int, logged: Sequence[Delta], stop_ids: Sequence[int]
    ) -> tuple[Assembler, StepResult]:
        """Choice ``index``'s assembler: new, or rebuilt from its logged deltas (with what
        it releases at once)."""
        fmt = job.tools
        tools = None if fmt is None else parser_for(fmt, call_ids(job.request_id, index))
        token_text = None if job.params.logprobs is None else self._token_text
        return Assembler.resume(  # (from no deltas: a new one, releasing nothing)
            self.model.tokenizer,
            logged,
            prompt_tokens=len(job.prompt_token_ids),
            stop=job.params.stop,
            stop_token_ids=stop_ids,
            tools=tools,
            token_text=token_text,
            index=index,
        )

    async def _choice(
        self,
        job: Job,
        index: int,
        owner: Owner,
        decisions: Mapping[str, State],
        logged: Sequence[Delta],
        handing_over: Container[str],
        first_token: FirstToken,
    ) -> Outcome:
        rid = job.request_id
        eid = engine_id(rid, index)
        params = choice_params(job.params, index)
        stop_ids = (*self.model.eos_token_ids, *params.stop_token_ids)
        try:
            asm, now = self._assembler(job, index, logged, stop_ids)
        except ResumeMismatch as exc:
            fresh = Assembler(self.model.tokenizer, prompt_tokens=len(job.prompt_token_ids))
            return Outcome(fresh.fail("resume_failed", str(exc)), None, "resume_failed")
        if logged:
            if now.events:
                await self.batcher.append(owner, now.events, give_up_at=job.deadline_unix_s)
            made = asm.token_ids
            if now.stopped or (made and made[-1] in stop_ids and not params.ignore_eos):
                # the previous worker logged the choice's last token, not its end
                return Outcome(asm.finish(State.FINISHED, FinishReason.STOP), None)
        generated = list(asm.token_ids)
        first_token_at: float | None = None
        covered: int | None = None
        budget = job.deadline_unix_s - time.time() if job.deadline_unix_s else None
        reason: str | None = None
        steps = Steps()
        try:
            async with asyncio.timeout(budget):
                gen = self.engine.generate(eid, job.prompt_token_ids, params, generated)
                async with contextlib.aclosing(gen):
                    async for out in gen:
                        steps.output(len(out.token_ids))
                        if rid in handing_over and rid not in decisions:
                            break
                        if out.token_ids and first_token_at is None:
                            first_token_at = time.time()
                            first_token.seen(first_token_at)
                        if rid in decisions:  # decided: count what the engine still made
                            covered = asm.completion_tokens if covered is None else covered
                            asm.completion_tokens += len(out.token_ids)
                            if out.finished:
                                break
                            continue
                        step = asm.step(out.token_ids, out.logprobs)
                        if step.events:
                            with steps.appending():
                                await self.batcher.append(
                                    owner, step.events, give_up_at=job.deadline_unix_s
                                )
                        if step.stopped:  # a stop string completed: free the engine now
                            await self.engine.abort(eid)
                            break
                        if out.finished:
                            reason = out.finish_reason
                            break
        except TimeoutError:
            await self.engine.abort(eid)
            msg = f"request exceeded its deadline of {self.deadline_s:g} s"
            return Outcome(asm.fail("deadline_exceeded", msg), first_token_at, "deadline")
        except EngineError as exc:
            return Outcome(asm.fail(exc.code, str(exc)), first_token_at, exc.code)
        decided = decisions.get(rid)
        if decided is None and rid in handing_over:
            return Outcome([], first_token_at, handed_over=True)
        if decided is not None:
            covered = asm.completion_tokens if covered is None else covered
            events = asm.finish(decided, ABORT_REASON[decided])
            return Outcome(events, first_token_at, covered_tokens=covered)
        if reason == "abort":  # the engine aborted on its own (e.g. shutting down)
            events = asm.fail("engine_aborted", "the engine aborted the request")
            return Outcome(events, first_token_at, "engine_aborted")
        return Outcome(asm.finish(State.FINISHED, reason), first_token_at)
