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
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

from service.stream.params import SamplingParams
from workers.engines.base import EngineError, StepOutput

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


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


class VllmEngine:
    name = "vllm"

    def __init__(self, config: VllmConfig) -> None:
        self.config = config
        self._llm: Any = None

    async def start(self) -> None:
        if self.config.kv_cache_gb is not None:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", f"{self.config.kv_cache_gb:g}")
        from vllm.engine.arg_utils import AsyncEngineArgs
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
        )
        self._llm = AsyncLLM.from_engine_args(args)

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
    ) -> AsyncGenerator[StepOutput, None]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self._llm is None:
            raise EngineError("the vLLM engine is not started", "engine_not_ready")
        left = params.max_tokens - len(generated)
        if left <= 0:
            yield StepOutput([], finished=True, finish_reason="length")
            return
        sampling = VSamplingParams(
            max_tokens=left,
            temperature=params.temperature,
            top_p=params.top_p,
            seed=params.seed,
            stop_token_ids=list(self.config.eos_token_ids),
            output_kind=RequestOutputKind.DELTA,
            detokenize=False,  # our protocol code detokenizes and applies stop strings
        )
        # a takeover: vLLM prefills the prompt and the ids made elsewhere, and continues
        prompt = TokensPrompt(prompt_token_ids=[*prompt_token_ids, *generated])
        try:
            async for out in self._llm.generate(prompt, sampling, request_id=request_id):
                completion = out.outputs[0]
                reason = None
                if out.finished:
                    reason = _FINISH.get(str(completion.finish_reason), "abort")
                ids = list(completion.token_ids)
                yield StepOutput(ids, finished=out.finished, finish_reason=reason)
                if out.finished:
                    return
        except Exception as exc:  # the engine died or rejected the request
            raise EngineError(f"vLLM failed: {exc}", "engine_error") from exc
        # the stream ended without a finished output: vLLM dropped it (aborted)
        yield StepOutput([], finished=True, finish_reason="abort")

    async def abort(self, request_id: str) -> None:
        if self._llm is not None:
            await self._llm.abort(request_id)
