"""The embedded CPU engine: the prepared safetensors model run with torch + transformers.

Meant for development, tests and small deployments. Requests are batched continuously
(``cpu_batch.py``): up to ``max_batch`` run at once on a single decode thread, joining
and leaving between steps, a joining prompt prefilled a chunk at a time; ``max_batch=1``
runs them one at a time (the engine before batching, kept for comparison). A
hand-written decode loop over the KV cache rather than ``model.generate``, so that an
abort, or a consumer that walks away, frees its slot at the next step.

Thread <-> loop hand-off: the decode thread pushes ``StepOutput``s (or the exception
that ended a request) into the request's ``asyncio.Queue`` with
``loop.call_soon_threadsafe``. torch, transformers and xgrammar are imported in the
decode thread, never at module import.

Sampling (``cpu_sampling.Sampler``) applies every ``SamplingParams`` field in vLLM's sampler order,
so that this engine and vLLM agree; structured output is xgrammar's, the library vLLM
uses, compiled on a thread of its own (``grammar.Grammars``: bounded in size, time and
memory) while the request waits to join the batch and the others decode.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

from service.stream.lifecycle import EngineFinish
from service.stream.params import SamplingParams
from workers.engines.base import EngineError, StepOutput, refuse_images
from workers.engines.cpu_batch import Scheduler, Seq
from workers.engines.cpu_sampling import Sampler
from workers.engines.grammar import TIMEOUT_S, Grammars

_ABORTED = StepOutput([], finished=True, finish_reason=EngineFinish.ABORT)
_REMEMBERED_EARLY_ABORTS = 1024
MAX_BATCH = 8  # requests decoded together (LASTEVENT_CPU_MAX_BATCH)
PREFILL_CHUNK = 256  # joining prompt tokens prefilled per step (the running ones wait)


@dataclasses.dataclass(slots=True)
class _Request:
    """One request's shared state between the event loop and the decode thread."""

    prompt_token_ids: list[int]
    params: SamplingParams
    emit: Callable[[StepOutput | BaseException], None]
    generated: list[int]  # made before, elsewhere (a takeover): prefilled after the prompt
    grammar: Any = None  # xgrammar's compiled grammar (structured output), made beforehand
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)


class CpuEngine:
    """Runs the prepared model in-process on CPU, requests batched continuously."""

    name = "cpu"
    continues = True
    images = False  # it takes no images (the API refuses them for its models)
    available = True  # (in this process: while it lives)

    def __init__(
        self,
        model_dir: Path,
        *,
        eos_token_ids: Sequence[int] = (),
        threads: int | None = None,
        max_batch: int = MAX_BATCH,
        prefill_chunk: int = PREFILL_CHUNK,
        grammar_timeout_s: float = TIMEOUT_S,
    ) -> None:
        """``eos_token_ids``: the ids that end a request (``finish_reason`` ``stop``);
        ``grammar_timeout_s``: the longest a request waits for its grammar to compile."""
        self.model_dir = Path(model_dir)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.threads = threads
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self._scheduler: Scheduler | None = None
        self._looping: concurrent.futures.Future[None] | None = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._model: Any = None
        self._cache_kw = "past_key_values"
        self._extra_kwargs: dict[str, Any] = {}
        self._max_len = 0
        self._vocab = 0  # the width of the model's logits (may exceed the tokenizer's)
        self.grammars = Grammars(self._tokenizer_info, timeout_s=grammar_timeout_s)
        self._active: dict[str, _Request] = {}
        # abort() may beat the first __anext__ of generate(); remember a bounded few.
        self._early_aborts: collections.OrderedDict[str, None] = collections.OrderedDict()

    # -- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        """Load the model on the decode thread, so the event loop keeps serving meanwhile."""
        if self._model is not None:
            return
        if self._executor is None:
            self._executor = concurrent.futures.ThreadPoolExecutor(
                max_workers=1, thread_name_prefix="cpu-engine"
            )
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(self._executor, self._load)
        except Exception as exc:
            raise EngineError(
                f"cpu engine: cannot load {self.model_dir}: {exc}", "engine_start"
            ) from exc
        self._scheduler = Scheduler(
            self._forward, self._admit, max_batch=self.max_batch, prefill_chunk=self.prefill_chunk
        )
        self._looping = self._executor.submit(self._loop, self._scheduler)

    async def close(self) -> None:
        """Abort everything in flight and let the decode thread finish its current step."""
        for request in list(self._active.values()):
            self._abort_request(request)
        scheduler, self._scheduler = self._scheduler, None
        if scheduler is not None:
            scheduler.closed = True
            scheduler.poke()
        executor, self._executor = self._executor, None
        if executor is not None:
            shutdown = functools.partial(executor.shutdown, wait=True, cancel_futures=True)
            await asyncio.get_running_loop().run_in_executor(None, shutdown)
        self.grammars.close()
        self._model = None

    def _load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if self.threads:
            torch.set_num_threads(self.threads)
        model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), dtype=torch.float32)
        model.eval()
        params = inspect.signature(model.forward).parameters
        # transformers 5 renamed the KV cache argument ``past_key_values`` -> ``cache``.
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        # Only the last position's logits are used; skip the rest of the prefill's.
        self._extra_kwargs = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._max_len = int(getattr(model.config, "max_position_embeddings", 0) or 0)
        self._vocab = int(model.get_output_embeddings().out_features)
        self._model = model

    # -- requests --------------------------------------------------------------------

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
        """Yield one ``StepOutput`` per generated token; the last one has ``finished``."""
        refuse_images(self.name, images)
        scheduler = self._scheduler
        if adapter is not None:  # (the worker refuses adapters at its start)
            raise EngineError("the cpu engine serves no adapters", "model_not_found")
        if self._model is None or scheduler is None:
            raise EngineError("cpu engine is not started", "engine_not_ready")
        if request_id in self._active:
            raise EngineError(f"request {request_id!r} is already running", "duplicate_request")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[StepOutput | BaseException] = asyncio.Queue()
        request = _Request(list(prompt_token_ids), params, _emitter(loop, queue), list(generated))
        self._active[request_id] = request
        if request_id in self._early_aborts:
            del self._early_aborts[request_id]
            self._abort_request(request)
        try:
            if params.structured is not None and not request.stop.is_set():
                # compiled off the decode thread: the batch decodes meanwhile
                request.grammar = await self.grammars.compiled(params.structured)
            scheduler.submit(request)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    if isinstance(item, EngineError):
                        raise item
                    raise EngineError(f"cpu engine failed: {item!r}") from item
                yield item
                if item.finished:
                    return
        finally:
            # Normal end, abort, error, or the consumer walked away: its slot is freed at
            # the decode thread's next step.
            request.stop.set()
            scheduler.poke()
            if self._active.get(request_id) is request:
                del self._active[request_id]

    async def abort(self, request_id: str) -> None:
        """End the request now: its generator yields the abort step next and returns."""
        request = self._active.get(request_id)
        if request is not None:
            self._abort_request(request)
            return
        self._early_aborts[request_id] = None
        while len(self._early_aborts) > _REMEMBERED_EARLY_ABORTS:
            self._early_aborts.popitem(last=False)

    def _abort_request(self, request: _Request) -> None:
        """Flag the thread and queue the abort step directly, so a waiting request ends too."""
        request.stop.set()
        request.emit(_ABORTED)
        if self._scheduler is not None:
            self._scheduler.poke()

    # -- the decode thread -----------------------------------------------------------

    @staticmethod
    def _loop(scheduler: Scheduler) -> None:
        """The decode thread's body: the scheduler's steps, under inference mode."""
        import torch

        with torch.inference_mode():
            scheduler.run()

    def _admit(self, request: _Request) -> Seq | None:
        """A request checked and its sampler made (on the decode thread): its ``Seq``, or
        None when it ended already (its error, or no token left to make)."""
        try:
            params = request.params
            self._validate(request.prompt_token_ids, request.generated, params)
            prompt = request.prompt_token_ids + request.generated
            left = params.max_tokens - len(request.generated)
            budget = min(left, self._max_len - len(prompt)) if self._max_len else left
            if budget <= 0:
                request.emit(StepOutput([], finished=True, finish_reason=EngineFinish.LENGTH))
                return None
            # masked before min_tokens, and what a finished grammar allows (as vLLM's stops)
            stops = self.eos_token_ids | frozenset(params.stop_token_ids)
            ends = frozenset(params.stop_token_ids) | (
                frozenset() if params.ignore_eos else self.eos_token_ids
            )
            matcher = self._matcher(request.grammar, stops)
            sampler = Sampler(params, prompt, request.generated, self._vocab, stops, matcher)
        except BaseException as exc:  # noqa: BLE001 - everything must reach the loop
            request.emit(exc)
            return None
        return Seq(request, sampler, ends, budget, prompt)

    def _validate(self, prompt: list[int], generated: list[int], params: SamplingParams) -> None:
        vocab = self._vocab
        if not prompt:
            raise EngineError("the prompt has no tokens", "invalid_request")
        for what, ids in (
            ("prompt token ids", prompt),
            ("generated token ids", generated),
            ("logit_bias token ids", params.logit_bias or ()),
            ("stop_token_ids", params.stop_token_ids),
        ):
            if any(not 0 <= t < vocab for t in ids):
                raise EngineError(f"{what} must be in [0, {vocab})", "invalid_request")
        if self._max_len and len(prompt) >= self._max_len:
            raise EngineError(
                f"the prompt has {len(prompt)} tokens; the model's context is {self._max_len}",
                "context_length_exceeded",
            )
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise EngineError("temperature must be >= 0 and top_p in (0, 1]", "invalid_request")

    @staticmethod
    def _matcher(grammar: Any, stops: frozenset[int]) -> Any:
        """An xgrammar matcher of ``grammar`` (None without: no structured output)."""
        if grammar is None:
            return None
        import xgrammar

        return xgrammar.GrammarMatcher(grammar, override_stop_tokens=sorted(stops))

    def _tokenizer_info(self) -> Any:
        """xgrammar's view of the tokenizer (on the compile thread, when first needed):
        the model's logits may be wider than the tokenizer, xgrammar masks the rest."""
        import xgrammar
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir))
        return xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self._vocab)

    def _forward(
        self, input_ids: Any, cache: Any, attention_mask: Any = None, position_ids: Any = None
    ) -> tuple[Any, Any]:
        """One model step over a batch; each row's last logits (float32) and the cache."""
        kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": True, self._cache_kw: cache}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        kwargs.update(self._extra_kwargs)
        out = self._model(**kwargs)
        new_cache = out.cache if self._cache_kw == "cache" else out.past_key_values
        return out.logits[:, -1].float(), new_cache


def _emitter(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[StepOutput | BaseException]
) -> Callable[[StepOutput | BaseException], None]:
    """Thread-safe put; a closed loop means nobody listens any more, which is fine."""

    def emit(item: StepOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(queue.put_nowait, item)

    return emit
