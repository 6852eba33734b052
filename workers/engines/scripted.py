"""The scripted engine: deterministic token ids through the real tokenizer.

For tests and benchmarks. By default it *echoes* the request: for a chat prompt
the content of the last user message, for a text prompt the prompt itself
(``scripted_text`` replaces that with a fixed answer). The answer is tokenized
with the model's own tokenizer and produced one token per step at
``tokens_per_s``, followed by EOS; so the rest of the system sees real token
ids, split characters and all. Fault injection: ``fail_after`` raises an engine
error after that many tokens, ``crash_after`` raises something that is not an
engine error (a bug), ``stall_after`` stops producing (for deadlines).

It is a test double, not a model: the sampling fields that shape a model's choice
(temperature, top_p, top_k, min_p, seed, the penalties, logit_bias, ``structured``)
do not change its script -- a test that wants JSON scripts JSON. It honours those
that decide *which ids and how many*: ``stop_token_ids`` (a script id among them
ends the request, ``stop``); ``ignore_eos`` (after the script's EOS the script
starts again, until ``max_tokens``); ``min_tokens`` (EOS and stop ids are skipped
before that many, as a model's are masked, and a script that ends sooner starts
again until then, then EOS). ``logprobs`` are synthetic but deterministic: the id
at completion position ``p`` has ``-0.01 * (p % 7 + 1)``, and its ``k``
alternatives are that id then ``id + 1``, ``id + 2``, ... one nat less each.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncGenerator, Iterator, Sequence

from service.stream.lifecycle import EngineFinish
from service.stream.logprobs import Sampled
from service.stream.params import SamplingParams
from service.tokenize import ModelInfo
from workers.engines.base import EngineError, StepOutput, refuse_images

_USER_OPEN = "<|im_start|>user\n"
_TURN_CLOSE = "<|im_end|>"


class ScriptedEngine:
    name = "scripted"
    continues = True
    images = False  # it takes no images (the API refuses them for its models)
    available = True  # (in this process: while it lives)

    def __init__(
        self,
        model: ModelInfo,
        *,
        tokens_per_s: float,  # (Settings' scripted_tokens_per_s)
        text: str | None = None,
        fail_after: int | None = None,
        stall_after: int | None = None,
        prefill_s: float = 0.0,
        crash_after: int | None = None,
        adapters: Sequence[str] = (),
    ) -> None:
        self._model = model
        self._adapters = frozenset(adapters)  # an adapter's answer starts with "[name] "
        self._interval_s = 1.0 / tokens_per_s if tokens_per_s > 0 else 0.0
        self._fixed = None if text is None else model.encode(text)
        self._filler = model.encode(".")  # repeated for min_tokens when the script is empty
        self._vocab = model.tokenizer.get_vocab_size(with_added_tokens=True)
        self._fail_after = fail_after
        self._stall_after = stall_after
        self._crash_after = crash_after
        self._prefill_s = prefill_s
        self._aborted: set[str] = set()
        self._abort_events: dict[str, asyncio.Event] = {}
        self._sleeps: dict[str, asyncio.Future[None]] = {}  # a step's wait, cut short by abort
        self.running: set[str] = set()  # request ids inside generate (tests look)

    async def start(self) -> None:
        return None

    async def close(self) -> None:
        return None

    def script_for(self, prompt_token_ids: list[int]) -> list[int]:
        if self._fixed is not None:
            return list(self._fixed)
        prompt = self._model.decode(prompt_token_ids, skip_special_tokens=False)
        start = prompt.rfind(_USER_OPEN)
        if start >= 0:
            body = prompt[start + len(_USER_OPEN) :]
            end = body.find(_TURN_CLOSE)
            return self._model.encode(body if end < 0 else body[:end])
        return self._model.encode(prompt)

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generated: Sequence[int] = (),
        *,
        adapter: str | None = None,
        conversation: bytes = b"",
        images: Sequence[bytes] = (),
    ) -> AsyncGenerator[StepOutput, None]:
        refuse_images(self.name, images)
        script = self.script_for(prompt_token_ids)
        if adapter is not None:
            if adapter not in self._adapters:
                raise EngineError(f"no adapter {adapter!r} here", "model_not_found")
            script = self._model.encode(f"[{adapter}] ") + script
        self.running.add(request_id)
        self._abort_events[request_id] = aborted = asyncio.Event()
        try:
            if self._prefill_s > 0:  # a long prefill that an abort interrupts
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(aborted.wait(), self._prefill_s)
            answer = self._answer(script, params)
            made = list(itertools.islice(answer, len(generated)))
            if list(generated) != made:
                raise EngineError("the generated ids are not this script's", "invalid_request")
            steps = self._steps(request_id, answer, len(generated), params)
            async for out in steps:
                yield out
        finally:
            self.running.discard(request_id)
            self._aborted.discard(request_id)
            self._abort_events.pop(request_id, None)
            self._sleeps.pop(request_id, None)

    def _answer(self, script: list[int], params: SamplingParams) -> Iterator[int]:
        """The ids of the whole answer, lazily (``ignore_eos`` makes it endless): it ends
        after an id that ends the request, or at the EOS once the script is done."""
        eos = self._model.eos_token_ids[:1]
        masked = {*self._model.eos_token_ids, *params.stop_token_ids}  # before min_tokens
        ends = {*params.stop_token_ids, *(() if params.ignore_eos else eos)}
        body = script or self._filler
        if params.min_tokens and all(t in masked for t in body):
            body = self._filler  # nothing left to say once they are skipped
        unit = [*body, *eos] if params.ignore_eos else body
        made = 0
        for position in itertools.count():
            if not params.ignore_eos and position >= len(script) and made >= params.min_tokens:
                yield from eos  # the script is done
                return
            token = unit[position % len(unit)]
            if token in masked and made < params.min_tokens:
                continue
            yield token
            made += 1
            if token in ends:
                return

    def _logprob(self, token_id: int, position: int, k: int) -> Sampled:
        logprob = -0.01 * (position % 7 + 1)
        top = tuple(((token_id + i) % self._vocab, logprob - i) for i in range(k))
        return Sampled(logprob, top)

    async def _steps(
        self, request_id: str, answer: Iterator[int], produced: int, params: SamplingParams
    ) -> AsyncGenerator[StepOutput, None]:
        """The rest of ``answer``, paced; ``produced`` ids were made before (a takeover)."""
        ends = {*params.stop_token_ids, *(() if params.ignore_eos else self._model.eos_token_ids)}
        next_at = time.monotonic()
        if produced >= params.max_tokens:
            yield StepOutput([], finished=True, finish_reason=EngineFinish.LENGTH)
            return
        for token_id in answer:
            if request_id in self._aborted:
                yield StepOutput([], finished=True, finish_reason=EngineFinish.ABORT)
                return
            if self._fail_after is not None and produced >= self._fail_after:
                raise EngineError(f"scripted failure after {produced} tokens", "engine_failure")
            if self._crash_after is not None and produced >= self._crash_after:
                # a bug, not an engine error
                raise RuntimeError(f"scripted crash after {produced} tokens")
            if self._stall_after is not None and produced >= self._stall_after:
                await self._abort_events[request_id].wait()  # stalled until aborted
                continue
            next_at += self._interval_s
            delay = next_at - time.monotonic()
            if delay > 0:
                await self._sleep(request_id, delay)
                if request_id in self._aborted:  # the abort lands now, not after the step
                    yield StepOutput([], finished=True, finish_reason=EngineFinish.ABORT)
                    return
            k = params.logprobs
            logprobs = None if k is None else [self._logprob(token_id, produced, k)]
            produced += 1
            # the script's own EOS, one inside the echoed text, or a stop id
            if token_id in ends or produced >= params.max_tokens:
                reason = EngineFinish.STOP if token_id in ends else EngineFinish.LENGTH
                yield StepOutput([token_id], finished=True, finish_reason=reason, logprobs=logprobs)
                return
            yield StepOutput([token_id], logprobs=logprobs)
        yield StepOutput([], finished=True, finish_reason=EngineFinish.STOP)  # a model without EOS

    async def _sleep(self, request_id: str, delay: float) -> None:
        """``asyncio.sleep`` that ``abort`` wakes early (a future, not a task per step)."""
        loop = asyncio.get_running_loop()
        self._sleeps[request_id] = wake = loop.create_future()
        timer = loop.call_later(delay, _resolve, wake)
        try:
            await wake
        finally:
            timer.cancel()

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self._aborted.add(request_id)
            sleeping = self._sleeps.get(request_id)
            if sleeping is not None:
                _resolve(sleeping)
            event = self._abort_events.get(request_id)
            if event is not None:
                event.set()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
