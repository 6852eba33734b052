"""The engine contract (tests/engine_contract.py) against the scripted and the CPU engine.

The vLLM engine runs the same contract in tests/vllm/test_vllm_contract.py.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import pytest

from service.tokenize import ModelInfo
from tests.engine_contract import EngineContract
from workers.engines.scripted import ScriptedEngine


class TestScriptedEngineContract(EngineContract):
    skips: ClassVar[Mapping[str, str]] = {
        "bad_prompt_raises_engine_error_then_serves_the_next": (
            "the scripted engine runs no model: it echoes whatever the prompt decodes to, "
            "so an out-of-vocabulary id or an empty prompt is not an error for it"
        ),
        "generate_before_start_raises_engine_error": "the scripted engine needs no start",
        **dict.fromkeys(
            (
                "logit_bias_decides_a_greedy_answer",
                "a_penalty_changes_a_greedy_answer",
                "structured_output_is_valid_json",
                "an_out_of_vocabulary_logit_bias_raises_engine_error",
            ),
            "a test double: the sampling fields that shape a model's choice (biases, "
            "penalties, structured output) do not change the script",
        ),
    }

    def held(self, engine: Any) -> int | None:
        return len(engine.running)

    @pytest.fixture
    def contract_engine(self, model: ModelInfo) -> ScriptedEngine:
        return ScriptedEngine(model, tokens_per_s=1000)


@pytest.fixture(scope="module")
def cpu_engine(model_dir: Path, model: ModelInfo) -> Iterator[Any]:
    """One loaded engine for the module; it holds no event-loop state between requests."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from workers.engines.cpu import CpuEngine

    engine = CpuEngine(model_dir, eos_token_ids=model.eos_token_ids, threads=os.cpu_count())
    asyncio.run(engine.start())
    yield engine
    asyncio.run(engine.close())


class TestCpuEngineContract(EngineContract):
    def held(self, engine: Any) -> int | None:
        return len(engine._active)  # the requests whose generator has not ended

    @pytest.fixture
    def contract_engine(self, cpu_engine: Any) -> Any:
        return cpu_engine

    @pytest.fixture
    def contract_cold_engine(self, model_dir: Path, model: ModelInfo) -> Any:
        from workers.engines.cpu import CpuEngine

        return CpuEngine(model_dir, eos_token_ids=model.eos_token_ids)
