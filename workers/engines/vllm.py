"""The production engine: vLLM's ``AsyncLLM``, fed token ids, streaming token-id deltas.

The only module that imports vllm. vLLM's own detokenizer is switched off
(``detokenize=False``): detokenization and stop strings happen in the project's
protocol code, exactly as for every other engine, so a stop string is seen one
engine step after the token that completes it. vLLM keeps generating until our
abort lands, which costs at most the tokens of the steps in flight (usually one;
they are counted in usage, never shown).

Continuous batching: vLLM batches every running request into each engine step;
its output handler hands one step's outputs to all request streams in one go,
and the worker's ``AppendBatcher`` sends all appends made in that loop iteration
as one pipelined round trip.

Every sampling field maps onto vLLM's own (``_sampling``); logprobs come back as
vLLM's flat per-token lists (the sampled id first, then the top ``k``), ids and
floats only. A takeover prefills the prompt and the ids made elsewhere, so vLLM sees
those as prompt: ``max_tokens`` and ``min_tokens`` are shortened by them, and what
counts *output* ids -- the presence and frequency penalties, a grammar's state --
goes to ``ContinuationProcessor``, a per-request logits processor vLLM loads by name
in its engine process, which counts the handed-over ids as output (the grammar's
mask then comes after vLLM's raw logprobs, not before as in a fresh request: the
ids are the same, the logprobs of a continued structured request are unmasked).
It has vLLM's V1 logits-processor interface: the V1 model runner (the CPU build's)
loads it; under the V2 model runner (vLLM's default on GPUs with Triton) it is not
registered, and such a continuation raises ``EngineError`` (``unsupported_continuation``)
rather than restart the grammar or the counts silently.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import os
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

from service.stream.lifecycle import EngineFinish
from service.stream.logprobs import Sampled
from service.stream.params import SamplingParams
from workers.engines import vllm_prompt
from workers.engines.base import EngineError, StepOutput

_FINISH = {"stop": EngineFinish.STOP, "length": EngineFinish.LENGTH, "abort": EngineFinish.ABORT}
_CONTINUATION = "lastevent_continuation"  # the extra_args key ContinuationProcessor reads
CONTINUATION_PROCESSOR = f"{__name__}:ContinuationProcessor"

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, slots=True)
class VllmConfig:
    model_dir: Path
    eos_token_ids: tuple[int, ...] = ()  # stop ids besides the ones vLLM reads from the model
    dtype: str = "auto"  # float32 on CPU (fastest start there), bfloat16/float16 on GPU
    max_model_len: int | None = None
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    kv_cache_gb: float | None = None  # CPU build: VLLM_CPU_KVCACHE_SPACE
    enforce_eager: bool = False  # True on CPU: torch.compile takes minutes there
    seed: int = 0
    adapters: tuple[tuple[str, str], ...] = ()  # LoRA adapters: (name, path), vLLM's --lora-modules
    max_lora_rank: int = 16


class VllmEngine:
    name = "vllm"
    continues = True
    images = False  # a vision model's worker takes images (``start`` reads the model)
    available = True  # (in this process: while it lives)

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self._llm: Any = None
        # ContinuationProcessor is a V1-runner processor: start() registers it there only
        self._continues = True

    async def start(self) -> None:
        if self.config.kv_cache_gb is not None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.config.kv_cache_gb:g}")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.usage.usage_lib import UsageContext
        from vllm.v1.engine.async_llm import AsyncLLM

        c = self.config
        args = AsyncEngineArgs(
            model=str(c.model_dir),
            dtype=c.dtype,
            max_model_len=c.max_model_len,
            tensor_parallel_size=c.tensor_parallel_size,
            gpu_memory_utilization=c.gpu_memory_utilization,
            enforce_eager=c.enforce_eager,
            seed=c.seed,
            disable_log_stats=True,
            **self._lora_args(),
        )
        vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
        self._continues = not vllm_config.use_v2_model_runner
        if self._continues:
            vllm_config.model_config.logits_processors = [CONTINUATION_PROCESSOR]
        self._llm = AsyncLLM.from_vllm_config(vllm_config, disable_log_stats=True)
        media = vllm_config.model_config.multimodal_config
        self.images = media is not None and media.get_limit_per_prompt("image") > 0

    def _lora_args(self) -> dict[str, Any]:
        if not self.config.adapters:
            return {}
        return {
            "enable_lora": True,
            "max_loras": len(self.config.adapters),
            "max_lora_rank": self.config.max_lora_rank,
        }

    def _lora(self, adapter: str | None) -> Any:
        """vLLM's ``LoRARequest`` of an adapter (ids from 1, in the order they were named)."""
        if adapter is None:
            return None
        from vllm.lora.request import LoRARequest

        for i, (name, path) in enumerate(self.config.adapters, start=1):
            if name == adapter:
                return LoRARequest(name, i, path)
        raise EngineError(f"no adapter {adapter!r} here", "model_not_found")

    async def close(self) -> None:
        if self._llm is not None:
            self._llm.shutdown()
            self._llm = None

    def num_unfinished_requests(self) -> int:
        """vLLM's own count of requests it still holds (tests assert aborts free them)."""
        return int(self._llm.output_processor.get_num_unfinished_requests())

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
        if self._llm is None:
            raise EngineError("the vLLM engine is not started", "engine_not_ready")
        left = params.max_tokens - len(generated)
        if left <= 0:
            yield StepOutput([], finished=True, finish_reason=EngineFinish.LENGTH)
            return
        sampling = self._sampling(params, generated, left)
        # a takeover: vLLM prefills the prompt and the ids made elsewhere, and continues
        prompt = await vllm_prompt.prompt([*prompt_token_ids, *generated], images, self.images)
        lora = self._lora(adapter)
        try:
            async for out in self._llm.generate(
                prompt, sampling, request_id=request_id, lora_request=lora
            ):
                completion = out.outputs[0]
                reason = None
                if out.finished:
                    if str(completion.finish_reason) == "error":
                        raise EngineError("vLLM failed the request", "engine_error")
                    reason = _FINISH.get(str(completion.finish_reason), EngineFinish.ABORT)
                ids = list(completion.token_ids)
                logprobs = None
                if params.logprobs is not None:
                    logprobs = _sampled(completion.logprobs, params.logprobs, len(ids))
                said = len(out.prompt_token_ids or ()) - len(generated) if images else None
                yield StepOutput(ids, out.finished, reason, logprobs, prompt_tokens=said)
                if out.finished:
                    return
        except EngineError:
            raise
        except Exception as exc:  # the engine died or rejected the request
            raise EngineError(f"vLLM failed: {exc}", "engine_error") from exc
        # the stream ended without a finished output: vLLM dropped it (aborted)
        yield StepOutput([], finished=True, finish_reason=EngineFinish.ABORT)

    def _sampling(self, params: SamplingParams, generated: Sequence[int], left: int) -> Any:
        """vLLM's ``SamplingParams`` for ours; ``left``: the ids still to make."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams

        p = params
        eos = () if p.ignore_eos else self.config.eos_token_ids
        penalties = {
            "presence_penalty": p.presence_penalty,
            "frequency_penalty": p.frequency_penalty,
            "repetition_penalty": p.repetition_penalty,
        }
        structured = None
        if p.structured is not None:
            if p.structured.kind == "json_object":
                structured = StructuredOutputsParams(json_object=True)
            elif p.structured.kind == "json_schema" and p.structured.schema is not None:
                structured = StructuredOutputsParams(json=p.structured.schema)
            else:
                raise EngineError(
                    f"unknown structured output {p.structured.kind!r}", "invalid_request"
                )
        extra = None
        if generated and (p.presence_penalty or p.frequency_penalty or structured is not None):
            # what counts output ids must count the handed-over ones: ContinuationProcessor
            if not self._continues:
                raise EngineError(
                    "vLLM's V2 model runner cannot continue a request under the presence or "
                    "frequency penalty or structured output (ContinuationProcessor is V1's)",
                    "unsupported_continuation",
                )
            extra, penalties = _continuation(p, generated, penalties)
            structured = None
        return VSamplingParams(
            max_tokens=left,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=max(p.top_k, 0),
            min_p=p.min_p,
            seed=p.seed,
            **penalties,
            min_tokens=min(max(p.min_tokens - len(generated), 0), left),
            ignore_eos=p.ignore_eos,
            logit_bias=dict(p.logit_bias) if p.logit_bias else None,
            stop_token_ids=list(dict.fromkeys((*p.stop_token_ids, *eos))),
            logprobs=p.logprobs,
            flat_logprobs=True,
            structured_outputs=structured,
            extra_args=extra,
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,  # our protocol code detokenizes and applies stop strings
        )

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)


def _continuation(
    params: SamplingParams, generated: Sequence[int], penalties: dict[str, float]
) -> tuple[dict[str, Any], dict[str, float]]:
    """``extra_args`` for ``ContinuationProcessor``, and the penalties vLLM still applies:
    with presence or frequency the processor applies all three, in vLLM's order
    (repetition, frequency, presence), and vLLM none."""
    structured = params.structured
    state: dict[str, Any] = {
        "generated": list(generated),
        "kind": None if structured is None else structured.kind,
        "schema": None if structured is None else structured.schema,
    }
    if params.presence_penalty or params.frequency_penalty:
        state.update(penalties)
        penalties = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    return {_CONTINUATION: state}, penalties


def _sampled(logprobs: Any, k: int, count: int) -> list[Sampled]:
    """vLLM's ``FlatLogprobs`` of one step's ``count`` ids: per position the sampled id
    first, then the ``k`` best (rank 1 first)."""
    out = []
    if logprobs is not None:
        for start, end in zip(logprobs.start_indices, logprobs.end_indices, strict=True):
            ids, values = logprobs.token_ids[start:end], logprobs.logprobs[start:end]
            top = tuple(zip(ids[1 : 1 + k], values[1 : 1 + k], strict=True))
            out.append(Sampled(float(values[0]), top))
    if len(out) != count:
        raise EngineError(f"vLLM gave {len(out)} logprobs for {count} ids", "engine_error")
    return out


# -- continuations (a takeover) under the penalties or structured output ----------------


def __getattr__(name: str) -> Any:
    """``ContinuationProcessor``, built on first use: vLLM loads it by this module's name
    in its engine process (``CONTINUATION_PROCESSOR``), and building it imports vllm."""
    if name == "ContinuationProcessor":
        return _continuation_processor()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _continuation_processor() -> type[Any]:
    from vllm.v1.sample.logits_processor import AdapterLogitsProcessor

    class ContinuationProcessor(AdapterLogitsProcessor):  # type: ignore[misc]
        """vLLM's hook for the requests that carry ``_CONTINUATION`` (see ``_Continuation``);
        the others pass untouched."""

        def __init__(self, vllm_config: Any, device: Any, is_pin_memory: bool) -> None:
            super().__init__(vllm_config, device, is_pin_memory)
            self._vllm_config = vllm_config
            self._backend: Any = None

        def is_argmax_invariant(self) -> bool:
            return False

        def new_req_logits_processor(self, params: Any) -> _Continuation | None:
            state = (params.extra_args or {}).get(_CONTINUATION)
            if state is None:
                return None
            stops = set(params.all_stop_token_ids)
            grammar = None if state["kind"] is None else self._grammar(state, stops)
            return _Continuation(state, grammar, stops)

        def _grammar(self, state: dict[str, Any], stops: set[int]) -> Any:
            """The grammar as vLLM's own xgrammar backend compiles it for a fresh request."""
            from vllm.tokenizers import cached_tokenizer_from_config
            from vllm.v1.structured_output.backend_types import StructuredOutputOptions
            from vllm.v1.structured_output.backend_xgrammar import XgrammarBackend

            if self._backend is None:
                model = self._vllm_config.model_config
                tokenizer = cached_tokenizer_from_config(model_config=model)
                self._backend = XgrammarBackend(
                    self._vllm_config, tokenizer=tokenizer, vocab_size=model.get_vocab_size()
                )
            if state["kind"] == "json_schema":
                option, spec = StructuredOutputOptions.JSON, state["schema"]
            else:
                option, spec = StructuredOutputOptions.JSON_OBJECT, ""
            return (
                self._backend.compile_grammar(option, spec, stop_token_ids=stops),
                self._backend.allocate_token_bitmask(1),
            )

    ContinuationProcessor.__module__ = __name__
    return ContinuationProcessor


class _Continuation:
    """One continued request's logits, each step: the grammar's mask, having seen the
    handed-over ids and vLLM's; then (when asked) the penalties in vLLM's order --
    repetition over the prompt (the handed-over ids are in it) and the output, frequency
    and presence over the handed-over ids and the output. Only tensor methods: vllm's
    torch, imported by vllm."""

    def __init__(self, state: dict[str, Any], grammar: Any, stops: set[int]) -> None:
        self._generated: list[int] = state["generated"]
        self._repetition = float(state.get("repetition_penalty", 1.0))
        self._frequency = float(state.get("frequency_penalty", 0.0))
        self._presence = float(state.get("presence_penalty", 0.0))
        self._counted = bool(self._frequency or self._presence)
        self._counts: collections.Counter[int] = collections.Counter()
        self._stops = sorted(stops)
        self._grammar: Any = None if grammar is None else grammar[0]
        self._bitmask: Any = None if grammar is None else grammar[1]
        self._broken = False
        self._seen = 0  # vLLM's output ids taken in so far
        self._penalty: Any = None  # frequency * count + presence, per id
        self._repeated: Any = None  # 1.0 where an id is in the prompt or the output
        self._take(self._generated)

    def __call__(self, prompt_ids: list[int], output_ids: list[int], logits: Any) -> Any:
        if self._penalty is None and self._counted:
            self._penalty = logits.new_zeros(logits.shape[-1])
            self._repeated = logits.new_zeros(logits.shape[-1])
            self._repeated[prompt_ids] = 1.0
            self._count(self._generated)
        new = output_ids[self._seen :]
        self._seen = len(output_ids)
        self._take(new)
        if self._counted:
            self._count(new)
        if self._broken:  # the handed-over ids break the grammar: end the request
            allowed = logits[self._stops].clone()
            logits.fill_(float("-inf"))
            logits[self._stops] = allowed
        elif self._grammar is not None and not self._grammar.is_terminated():
            import xgrammar

            self._grammar.fill_bitmask(self._bitmask, 0)
            bitmask = self._bitmask.to(logits.device)
            xgrammar.apply_token_bitmask_inplace(logits.unsqueeze(0), bitmask)
        if self._counted:
            rp = self._repetition
            if rp != 1.0:
                scaled = (logits / rp).where(logits > 0, logits * rp)
                logits = scaled.where(self._repeated > 0, logits)
            logits = logits - self._penalty
        return logits

    def _take(self, ids: list[int]) -> None:
        """Advance the grammar (it ignores the ids after its end, as vLLM's)."""
        if self._grammar is None or not ids or self._broken:
            return
        if not self._grammar.accept_tokens("continuation", ids):
            log.error("the handed-over ids do not follow the requested structure")
            self._broken = True

    def _count(self, ids: list[int]) -> None:
        for token in ids:
            self._penalty[token] += self._frequency
            if not self._counts[token]:
                self._penalty[token] += self._presence
                self._repeated[token] = 1.0
            self._counts[token] += 1
