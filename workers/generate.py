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
import time
from collections.abc import Container, Mapping, Sequence

from service.store.log import AppendBatcher, Owner
from service.store.queue import Job
from service.stream.assemble import Assembler, ResumeMismatch
from service.stream.events import Delta, Event
from service.stream.lifecycle import ABORT_REASON, FinishReason, State
from service.tokenize import ModelInfo
from workers.engines.base import Engine, EngineError


@dataclasses.dataclass(slots=True)
class Outcome:
    events: list[Event]  # the last one is the terminal End
    first_token_at: float | None
    error_code: str | None = None
    covered_tokens: int | None = None  # tokens made before an abort decision (None: no abort)
    handed_over: bool = False  # stopped for another worker to continue: no terminal event


class Generation:
    def __init__(
        self, engine: Engine, model: ModelInfo, batcher: AppendBatcher, deadline_s: float
    ) -> None:
        self.engine = engine
        self.model = model
        self.batcher = batcher
        self.deadline_s = deadline_s

    async def run(
        self,
        job: Job,
        owner: Owner,
        decisions: Mapping[str, State],
        *,
        logged: Sequence[Delta] = (),
        handing_over: Container[str] = (),
    ) -> Outcome:
        """Generate until the engine finishes, a stop string completes, the deadline
        passes, or ``decisions`` gets this request (cancel / abandon: the caller has
        asked the engine to abort, and the tokens it still makes are counted), or
        ``handing_over`` does (the engine was aborted; another worker continues).
        ``logged``: the deltas of a request another worker started."""
        rid = job.request_id
        asm = Assembler(
            self.model.tokenizer,
            prompt_tokens=len(job.prompt_token_ids),
            stop=job.params.stop,
            stop_token_ids=self.model.eos_token_ids,
        )
        if logged:
            try:
                asm, now = Assembler.resume(
                    self.model.tokenizer,
                    logged,
                    prompt_tokens=len(job.prompt_token_ids),
                    stop=job.params.stop,
                    stop_token_ids=self.model.eos_token_ids,
                )
            except ResumeMismatch as exc:
                return Outcome(asm.fail("resume_failed", str(exc)), None, "resume_failed")
            if now.events:
                await self.batcher.append(owner, now.events, give_up_at=job.deadline_unix_s)
            made = asm.token_ids
            if now.stopped or (made and made[-1] in self.model.eos_token_ids):
                # the previous worker logged the request's last token, not its end
                return Outcome(asm.finish(State.FINISHED, FinishReason.STOP), None)
        generated = list(asm.token_ids)
        first_token_at: float | None = None
        covered: int | None = None
        budget = job.deadline_unix_s - time.time() if job.deadline_unix_s else None
        reason: str | None = None
        try:
            async with asyncio.timeout(budget):
                gen = self.engine.generate(rid, job.prompt_token_ids, job.params, generated)
                async with contextlib.aclosing(gen):
                    async for out in gen:
                        if rid in handing_over and rid not in decisions:
                            break
                        if out.token_ids and first_token_at is None:
                            first_token_at = time.time()
                        if rid in decisions:  # decided: count what the engine still made
                            covered = asm.completion_tokens if covered is None else covered
                            asm.completion_tokens += len(out.token_ids)
                            if out.finished:
                                break
                            continue
                        step = asm.step(out.token_ids)
                        if step.events:
                            await self.batcher.append(
                                owner, step.events, give_up_at=job.deadline_unix_s
                            )
                        if step.stopped:  # a stop string completed: free the engine now
                            await self.engine.abort(rid)
                            break
                        if out.finished:
                            reason = out.finish_reason
                            break
        except TimeoutError:
            await self.engine.abort(rid)
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
