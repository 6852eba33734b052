"""The embedded CPU engine: the prepared safetensors model run with torch + transformers.

Meant for development, tests and tiny deployments, not throughput: requests run one at
a time on a single worker thread (others queue behind it), one token per step, with a
hand-written decode loop over the KV cache rather than ``model.generate`` so that an
abort, or a consumer that walks away, is noticed before the next token is computed.

Thread <-> loop hand-off: the decode thread pushes ``StepOutput``s (or the exception
that killed it) into the request's ``asyncio.Queue`` with ``loop.call_soon_threadsafe``.
torch and transformers are imported in the worker thread, never at module import.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import inspect
import secrets
import threading
from collections.abc import AsyncGenerator, Callable, Sequence
from pathlib import Path
from typing import Any

from service.stream.params import SamplingParams
from workers.engines.base import EngineError, StepOutput

_ABORTED = StepOutput([], finished=True, finish_reason="abort")
_REMEMBERED_EARLY_ABORTS = 1024


@dataclasses.dataclass(slots=True)
class _Request:
    """One request's shared state between the event loop and the decode thread."""

    prompt_token_ids: list[int]
    params: SamplingParams
    emit: Callable[[StepOutput | BaseException], None]
    generated: list[int]  # made before, elsewhere (a takeover): prefilled after the prompt
    stop: threading.Event = dataclasses.field(default_factory=threading.Event)


class CpuEngine:
    """Runs the prepared model in-process on CPU, one request at a time."""

    name = "cpu"

    def __init__(
        self, model_dir: Path, *, eos_token_ids: Sequence[int] = (), threads: int | None = None
    ) -> None:
        """``eos_token_ids``: the ids that end a request (``finish_reason`` ``stop``)."""
        self.model_dir = Path(model_dir)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.threads = threads
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._model: Any = None
        self._cache_kw = "past_key_values"
        self._extra_kwargs: dict[str, Any] = {}
        self._max_len = 0
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

    async def close(self) -> None:
        """Abort everything in flight and let the decode thread finish its current step."""
        for request in list(self._active.values()):
            self._abort_request(request)
        executor, self._executor = self._executor, None
        if executor is not None:
            shutdown = functools.partial(executor.shutdown, wait=True, cancel_futures=True)
            await asyncio.get_running_loop().run_in_executor(None, shutdown)
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
        self._model = model

    # -- requests --------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        generated: Sequence[int] = (),
    ) -> AsyncGenerator[StepOutput, None]:
        """Yield one ``StepOutput`` per generated token; the last one has ``finished``."""
        if self._model is None or self._executor is None:
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
        future = loop.run_in_executor(self._executor, self._run, request)
        try:
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
            # Normal end, abort, error, or the consumer walked away: stop the thread.
            request.stop.set()
            future.cancel()
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

    @staticmethod
    def _abort_request(request: _Request) -> None:
        """Flag the thread and queue the abort step directly, so a waiting request ends too."""
        request.stop.set()
        request.emit(_ABORTED)

    # -- the decode thread -----------------------------------------------------------

    def _run(self, request: _Request) -> None:
        """Executor entry point: decode, and turn any failure into a queue item."""
        if request.stop.is_set():
            return
        try:
            self._decode(request)
        except BaseException as exc:  # noqa: BLE001 - everything must reach the loop
            request.emit(exc)

    def _decode(self, request: _Request) -> None:
        import torch

        params = request.params
        self._validate(request.prompt_token_ids, params)
        if any(not 0 <= t < int(self._model.config.vocab_size) for t in request.generated):
            raise EngineError("generated token ids must be in the vocabulary", "invalid_request")
        prompt = request.prompt_token_ids + request.generated
        left = params.max_tokens - len(request.generated)
        budget = min(left, self._max_len - len(prompt)) if self._max_len else left
        if budget <= 0:
            request.emit(StepOutput([], finished=True, finish_reason="length"))
            return
        generator = torch.Generator().manual_seed(
            params.seed if params.seed is not None else secrets.randbits(63)
        )
        stop_ids = self.eos_token_ids
        with torch.inference_mode():
            logits, cache = self._forward(torch.tensor([prompt], dtype=torch.long), None)
            for produced in range(1, budget + 1):
                if request.stop.is_set():
                    return
                token = _sample(logits, params.temperature, params.top_p, generator)
                if token in stop_ids:
                    request.emit(StepOutput([token], finished=True, finish_reason="stop"))
                    return
                if produced == budget:
                    request.emit(StepOutput([token], finished=True, finish_reason="length"))
                    return
                request.emit(StepOutput([token]))
                logits, cache = self._forward(torch.tensor([[token]], dtype=torch.long), cache)

    def _validate(self, prompt: list[int], params: SamplingParams) -> None:
        vocab = int(self._model.config.vocab_size)
        if not prompt:
            raise EngineError("the prompt has no tokens", "invalid_request")
        if any(not 0 <= t < vocab for t in prompt):
            raise EngineError(f"prompt token ids must be in [0, {vocab})", "invalid_request")
        if self._max_len and len(prompt) >= self._max_len:
            raise EngineError(
                f"the prompt has {len(prompt)} tokens; the model's context is {self._max_len}",
                "context_length_exceeded",
            )
        if params.temperature < 0 or not 0 < params.top_p <= 1:
            raise EngineError("temperature must be >= 0 and top_p in (0, 1]", "invalid_request")

    def _forward(self, input_ids: Any, cache: Any) -> tuple[Any, Any]:
        """One model step; returns the last position's logits (float32) and the new cache."""
        kwargs: dict[str, Any] = {"input_ids": input_ids, "use_cache": True, self._cache_kw: cache}
        kwargs.update(self._extra_kwargs)
        out = self._model(**kwargs)
        new_cache = out.cache if self._cache_kw == "cache" else out.past_key_values
        return out.logits[0, -1].float(), new_cache


def _emitter(
    loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[StepOutput | BaseException]
) -> Callable[[StepOutput | BaseException], None]:
    """Thread-safe put; a closed loop means nobody listens any more, which is fine."""

    def emit(item: StepOutput | BaseException) -> None:
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(queue.put_nowait, item)

    return emit


def _sample(logits: Any, temperature: float, top_p: float, generator: Any) -> int:
    """Greedy at temperature 0, else nucleus sampling with the request's own generator."""
    import torch

    if temperature == 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        keep = (torch.cumsum(sorted_probs, dim=-1) - sorted_probs) < top_p
        sorted_probs = sorted_probs * keep
        choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=generator)
        return int(order[choice])
    return int(torch.multinomial(probs, 1, generator=generator))
