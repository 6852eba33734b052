"""The engine contract (tests/engine_contract.py) against the real vLLM engine (CPU build).

The scripted and the CPU engine run the same contract in
tests/integration/test_engine_contract.py; vLLM's own cases (batching, its request
count after an abort, the runner over it) are in test_vllm_engine.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from service.tokenize import ModelInfo
from tests.engine_contract import EngineContract

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore"),  # vLLM's own deprecation noise
    pytest.mark.asyncio(loop_scope="module"),
]


def vllm_config(model_dir: Path, model: ModelInfo) -> Any:
    from workers.engines.vllm import VllmConfig

    # the CPU build's settings that start quickest (see tests/vllm/conftest.py)
    return VllmConfig(
        model_dir=model_dir,
        eos_token_ids=model.eos_token_ids,
        dtype="float32",
        enforce_eager=True,
        kv_cache_gb=1,
        max_model_len=2048,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_engine(model_dir: Path, model: ModelInfo) -> AsyncIterator[Any]:
    from workers.engines.vllm import VllmEngine

    engine = VllmEngine(vllm_config(model_dir, model))
    await engine.start()
    yield engine
    await engine.close()


class TestVllmEngineContract(EngineContract):
    def held(self, engine: Any) -> int | None:
        return int(engine.num_unfinished_requests())

    @pytest.fixture
    def contract_engine(self, vllm_engine: Any) -> Any:
        return vllm_engine

    @pytest.fixture
    def contract_cold_engine(self, model_dir: Path, model: ModelInfo) -> Any:
        from workers.engines.vllm import VllmEngine

        return VllmEngine(vllm_config(model_dir, model))  # built, never started
