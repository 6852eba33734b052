"""The engine contract (tests/engine_contract.py) on the upstream engine, in front of
``tests/upstream_server.py`` run as a process of its own over the CPU engine: every
request crosses real HTTP (SSE, token ids, logprobs as ``token_id:N``) both ways.

``held``: the engine's own open requests plus what the server's ``/metrics`` says it
still runs, so an abort or a consumer that walks away must reach the server's engine.
``tests/vllm`` runs the same contract against the real ``vllm serve``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar

import httpx
import pytest

from service.settings import MODEL_NAME, Settings
from service.tokenize import ModelInfo
from tests.engine_contract import EngineContract
from tests.upstream_server import ServerProcess
from workers.engines.upstream import UpstreamConfig, UpstreamEngine


@pytest.fixture(scope="module")
def upstream(upstream_server: ServerProcess) -> ServerProcess:
    return upstream_server  # (tests/conftest.py)


def config_for(server: ServerProcess, model: ModelInfo, **settings: Any) -> UpstreamConfig:
    """A process's default numbers (``Settings``), but those in ``settings``."""
    defaults = Settings()
    numbers = {
        "idle_timeout_s": defaults.upstream_idle_timeout_s,
        "first_token_timeout_s": defaults.upstream_first_token_timeout_s,
        "retry_s": defaults.upstream_retry_s,
    }
    return UpstreamConfig(
        urls=(server.url,),
        model=MODEL_NAME,
        eos_token_ids=tuple(model.eos_token_ids),
        **{**numbers, **settings},
    )


class TestUpstreamEngineContract(EngineContract):
    skips: ClassVar[Mapping[str, str]] = {
        "a_continuation_under_structured_output_or_penalties_is_the_rest": (
            "the upstream sees the ids handed over as prompt, so its presence and frequency "
            "penalties and its grammar would start again: the upstream engine refuses such a "
            "continuation (unsupported_continuation; tests/integration/test_upstream_faults.py)"
        ),
    }

    def held(self, engine: Any) -> int | None:
        base = engine.config.urls[0].removesuffix("/v1")
        text = httpx.get(f"{base}/metrics", timeout=5).text
        gauges = [line.split()[-1] for line in text.splitlines() if line.startswith("vllm:")]
        return len(engine._live) + int(sum(float(v) for v in gauges))

    @pytest.fixture
    async def contract_engine(
        self, upstream: ServerProcess, model: ModelInfo
    ) -> AsyncIterator[UpstreamEngine]:
        engine = UpstreamEngine(config_for(upstream, model))
        await engine.start()
        assert engine.available
        yield engine
        await engine.close()

    @pytest.fixture
    def contract_cold_engine(self, upstream: ServerProcess, model: ModelInfo) -> UpstreamEngine:
        return UpstreamEngine(config_for(upstream, model))
