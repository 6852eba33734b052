"""One request through the engine: token ids in, log events out.

Each of the request's choices is an engine request of its own. Every engine output of a
choice goes, with the request's control signals, into its ``decide.ChoiceRun``, a
state machine without I/O; this module applies what it returns -- append the deltas
(through the ``AppendBatcher``: one script call per flush for all of the worker's
requests), abort the engine -- until the choice is over. What each choice came to
(``endings.Stopped``) goes back to the runner, which turns them into the request's
ending and writes it with the outbox entry.

A request another worker started (a takeover or a handover) is continued from the
deltas in its log: the assembler is rebuilt from them (``Assembler.resume``) and the
engine prefills the prompt and their ids, and makes the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Callable, Sequence

import msgspec

from service.store.batcher import AppendBatcher
from service.store.log import Fenced, Owner
from service.store.queue import Job
from service.stream import endings
from service.stream.assemble import Assembler, ResumeMismatch
from service.stream.endings import Failure, Stopped
from service.stream.events import Delta, Event
from service.stream.logprobs import TokenText
from service.stream.params import SamplingParams
from service.stream.tools import parser_for
from service.tokenize import ModelInfo
from workers.decide import Action, ChoiceRun, Signals
from workers.engines.base import Engine, EngineError
from workers.metrics import FirstToken, Steps

# a request another worker started, on an engine that cannot continue it (an upstream
# in text mode: the log holds the text, no ids to prefill)
NOT_CONTINUABLE = Failure(
    "worker_lost", "the worker serving this request was lost, and its engine cannot continue it"
)


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
        # running request -> (worker, how it came to run it): put on its first delta
        self._marks: dict[str, tuple[str, str]] = {}
        # running request -> its prompt's tokens as the engine counted them (images), when
        # the engine said: the ending's usage (the runner takes it out)
        self.prompt_tokens: dict[str, int] = {}

    async def abort(self, request_id: str) -> None:
        """Abort every choice of a request in the engine."""
        for index in range(self._choices.get(request_id, 1)):
            await self.engine.abort(engine_id(request_id, index))

    async def run(
        self,
        job: Job,
        owner: Owner,
        signals: Signals,
        first_token: FirstToken,
        *,
        logged: Sequence[Delta] = (),
        mark: tuple[str, str] | None = None,
    ) -> list[Stopped]:
        """Generate every choice of ``job`` until each is over, and say how (in choice
        order). ``signals``: the request's cancel / abandon / handover, set by the runner
        (which aborts the engine as it sets one); ``logged``: the deltas of a request
        another worker started; ``mark``: (worker, how) for the first delta appended."""
        rid = job.request_id
        n = max(job.n, 1)
        self._choices[rid] = n
        if mark is not None:
            self._marks[rid] = mark
        try:
            return list(
                await asyncio.gather(
                    *(
                        self._choice(
                            job, i, owner, signals, [d for d in logged if d.index == i], first_token
                        )
                        for i in range(n)
                    )
                )
            )
        finally:
            self._choices.pop(rid, None)
            self._marks.pop(rid, None)

    def _start(
        self, job: Job, index: int, params: SamplingParams, logged: Sequence[Delta]
    ) -> tuple[ChoiceRun, Action]:
        """Choice ``index``'s run: new, or rebuilt from its logged deltas (with what they
        release at once). Raises ``ResumeMismatch``."""
        stop_ids = (*self.model.eos_token_ids, *params.stop_token_ids)
        fmt = job.tools
        asm, now = Assembler.resume(  # (from no deltas: a new one, releasing nothing)
            self.model.tokenizer,
            logged,
            prompt_tokens=len(job.prompt_token_ids),
            stop=params.stop,
            stop_token_ids=stop_ids,
            tools=None if fmt is None else parser_for(fmt, call_ids(job.request_id, index)),
            token_text=None if params.logprobs is None else self._token_text,
            index=index,
        )
        run = ChoiceRun(asm, index, stop_ids=stop_ids, ignore_eos=params.ignore_eos)
        return run, run.resumed(now) if logged else Action()

    async def _choice(
        self,
        job: Job,
        index: int,
        owner: Owner,
        signals: Signals,
        logged: Sequence[Delta],
        first_token: FirstToken,
    ) -> Stopped:
        params = choice_params(job.params, index)
        if logged and not self.engine.continues:  # (the log holds text, no ids)
            made = logged[-1].n
            return endings.failed_choice(index, NOT_CONTINUABLE, made, made)
        try:
            run, action = self._start(job, index, params, logged)
        except ResumeMismatch as exc:
            return endings.failed_choice(index, Failure("resume_failed", str(exc)), 0)
        eid = engine_id(job.request_id, index)
        steps = Steps(job.model or self.model.name)
        budget = job.deadline_unix_s - time.time() if job.deadline_unix_s else None
        stop: Action | None = None
        try:
            async with asyncio.timeout(budget):
                if not await self._apply(action, owner, eid, job, steps):
                    action = await self._generate(
                        run, eid, job, params, signals, first_token, owner, steps
                    )
        except TimeoutError:
            stop = run.failed(endings.deadline(self.deadline_s), abort=True)
        except EngineError as exc:
            stop = run.failed(Failure(exc.code, str(exc)))
        except Fenced:
            stop = run.fenced()
        if stop is not None:  # (nothing more for the log: only the engine to abort)
            await self._apply(stop, owner, eid, job, steps)
            action = stop
        assert action.stop is not None
        return action.stop

    async def _generate(
        self,
        run: ChoiceRun,
        eid: str,
        job: Job,
        params: SamplingParams,
        signals: Signals,
        first_token: FirstToken,
        owner: Owner,
        steps: Steps,
    ) -> Action:
        """Step the engine until the choice is over; the action that ended it (applied)."""
        adapter = job.model if job.model and job.model != self.model.name else None
        made = list(run.asm.token_ids)
        gen = self.engine.generate(
            eid,
            job.prompt_token_ids,
            params,
            made,
            adapter=adapter,
            conversation=job.conversation,
            images=job.images,
        )
        async with contextlib.aclosing(gen):
            async for out in gen:
                if out.prompt_tokens is not None:
                    self.prompt_tokens[job.request_id] = out.prompt_tokens
                steps.output(len(out.token_ids) or int(bool(out.text)))
                if (out.token_ids or out.text) and first_token.at is None:
                    first_token.seen(time.time())
                action = run.step(out, signals)
                if await self._apply(action, owner, eid, job, steps):
                    return action
        action = run.exhausted(signals)
        await self._apply(action, owner, eid, job, steps)
        return action

    async def _apply(
        self,
        action: Action,
        owner: Owner,
        eid: str,
        job: Job,
        steps: Steps,
    ) -> bool:
        """Do what ``action`` says; whether the choice is over."""
        if action.append:
            events = self._marked(job.request_id, action.append)
            since = time.monotonic()
            try:
                await self.batcher.append(owner, events, give_up_at=job.deadline_unix_s)
            finally:
                steps.appended(since)
        if action.abort:
            await self.engine.abort(eid)
        return action.stop is not None

    def _marked(self, rid: str, events: Sequence[Event]) -> Sequence[Event]:
        """``events``, the first delta of the run marked with its worker and claim."""
        mark = self._marks.get(rid)
        if mark is None:
            return events
        for i, event in enumerate(events):
            if isinstance(event, Delta):
                del self._marks[rid]
                by, how = mark
                marked = msgspec.structs.replace(event, by=by, how=how)
                return [*events[:i], marked, *events[i + 1 :]]
        return events
