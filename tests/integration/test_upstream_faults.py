"""The upstream engine's faults, each for real against ``tests/upstream_server.py`` run
as a process of its own: refusals with ``Retry-After``, a stream cut or hung mid-answer,
faults that outlast ``retry_s``, a 400, the server killed and started again, an abort.

The CPU engine serves greedily (temperature 0), so an answer continued after a fault
must be the uninterrupted one id for id; the server's ``GET /_faults`` lists the
completions calls it received, so each test also sees what was asked again, and from
where. Nothing here times anything: ``eventually`` only keeps a broken case from hanging.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.stream.params import SamplingParams, Structured
from service.tokenize import ModelInfo
from tests.engine_contract import LONG, SAFETY_S, chat_ids, ids_of
from tests.integration.test_upstream_contract import config_for
from tests.upstream_server import ServerProcess
from tests.waiting import eventually
from workers.engines import upstream_wire as wire
from workers.engines.base import EngineError, StepOutput
from workers.engines.upstream import UpstreamEngine

pytestmark = pytest.mark.timeout(300)

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)
NO_FAULTS = {kind: {"count": 0} for kind in ("refuse", "cut", "hang")}


@pytest.fixture(scope="module")
def upstream(upstream_server: ServerProcess) -> ServerProcess:
    return upstream_server  # (tests/conftest.py)


@pytest.fixture
def server(upstream: ServerProcess) -> Iterator[ServerProcess]:
    """The module's server, with no fault left over from a test before."""
    upstream.faults(**NO_FAULTS)
    yield upstream
    upstream.faults(**NO_FAULTS)


@pytest.fixture
def prompt(model: ModelInfo) -> list[int]:
    return chat_ids(model, LONG)


async def started(server: ServerProcess, model: ModelInfo, **settings: Any) -> UpstreamEngine:
    engine = UpstreamEngine(config_for(server, model, **settings))
    await engine.start()
    return engine


@pytest.fixture
async def engine(server: ServerProcess, model: ModelInfo) -> AsyncIterator[UpstreamEngine]:
    engine = await started(server, model, retry_s=60.0)  # (a safety net: none outlasts it)
    yield engine
    await engine.close()


async def run(
    engine: UpstreamEngine, prompt: list[int], params: SamplingParams = GREEDY
) -> list[StepOutput]:
    async with asyncio.timeout(SAFETY_S):
        steps = engine.generate(f"faults-{uuid.uuid4().hex[:8]}", prompt, params)
        return [step async for step in steps]


async def reference(server: ServerProcess, model: ModelInfo, params: SamplingParams) -> list[int]:
    """The uninterrupted answer (a fresh engine: no fault is set)."""
    engine = await started(server, model)
    try:
        return ids_of(await run(engine, chat_ids(model, LONG), params))
    finally:
        await engine.close()


async def failure(engine: UpstreamEngine, prompt: list[int], params: SamplingParams) -> EngineError:
    with pytest.raises(EngineError) as raised:
        await run(engine, prompt, params)
    return raised.value


# -- refused before anything was sent: asked again, the answer completes ---------------


@pytest.mark.parametrize(
    ("status", "retry_after", "count"),
    [(503, "0", 2), (429, "1", 1), (502, None, 2), (408, "Thu, 01 Jan 1970 00:00:00 GMT", 1)],
)
async def test_a_refusal_before_anything_is_asked_again_and_the_answer_completes(
    server: ServerProcess,
    engine: UpstreamEngine,
    model: ModelInfo,
    prompt: list[int],
    status: int,
    retry_after: str | None,
    count: int,
) -> None:
    want = await reference(server, model, GREEDY)
    before = len(server.calls())
    server.faults(refuse={"count": count, "status": status, "retry_after": retry_after})
    steps = await run(engine, prompt)
    assert ids_of(steps) == want and steps[-1].finish_reason == "length"
    calls = server.calls()[before:]
    assert len(calls) == count + 1  # each refusal asked again once, then the answer
    assert all(c["prompt"] == prompt and c["max_tokens"] == 16 for c in calls)


# -- cut or hung mid-answer: continued from where it is, greedy-exact ----------------


@pytest.mark.parametrize("cuts", [1, 3])
async def test_a_stream_cut_mid_answer_is_continued_to_the_uninterrupted_answer(
    server: ServerProcess,
    engine: UpstreamEngine,
    model: ModelInfo,
    prompt: list[int],
    cuts: int,
) -> None:
    params = SamplingParams(max_tokens=16, temperature=0.0, logprobs=2)
    want = await reference(server, model, params)
    before = len(server.calls())
    server.faults(cut={"count": cuts, "after": 3})  # each call: 3 chunks (one id each), cut
    steps = await run(engine, prompt, params)
    assert ids_of(steps) == want and steps[-1].finish_reason == "length"
    assert all(s.logprobs is not None and len(s.logprobs) == len(s.token_ids) for s in steps)
    calls = server.calls()[before:]
    assert len(calls) == cuts + 1
    for n, call in enumerate(calls):  # asked again from where the answer was
        made = 3 * n
        assert call["prompt"] == prompt + want[:made]
        assert call["max_tokens"] == params.max_tokens - made


async def test_a_stream_hung_mid_answer_is_given_up_and_continued(
    server: ServerProcess, model: ModelInfo, prompt: list[int]
) -> None:
    want = await reference(server, model, GREEDY)
    before = len(server.calls())
    server.faults(hang={"count": 1, "after": 4})
    engine = await started(server, model, idle_timeout_s=3.0, retry_s=60.0)
    try:
        steps = await run(engine, prompt)
    finally:
        await engine.close()
    assert ids_of(steps) == want and steps[-1].finish_reason == "length"
    calls = server.calls()[before:]
    # (a call slower than the idle timeout is asked again too: at least the hung one)
    assert len(calls) >= 2 and calls[1]["prompt"] == prompt + want[:4]
    # the hung call's connection was closed, and the server let go of its request
    await eventually(lambda: server.held() == 0, "the server to let go of the hung call")


# -- faults that outlast retry_s: the request ends with the fault's own code -----------


@pytest.mark.parametrize(
    ("faults", "then", "code"),
    [
        # (Retry-After: 0 every time: the backoff still spaces the calls)
        ({"refuse": {"count": 10**6, "status": 503, "retry_after": "0"}}, None, wire.UNAVAILABLE),
        # three ids, then every call cut before its first chunk: no progress after them
        ({"cut": {"count": 1, "after": 3}}, {"cut": {"count": 10**6, "after": 0}}, wire.CUT),
        ({"hang": {"count": 10**6, "after": 0}}, None, wire.TIMEOUT),
    ],
    ids=["unavailable", "cut", "timeout"],
)
async def test_a_fault_that_outlasts_retry_s_ends_with_its_code(
    server: ServerProcess,
    model: ModelInfo,
    prompt: list[int],
    faults: Any,
    then: Any,
    code: str,
) -> None:
    before = len(server.calls())
    server.faults(**faults)
    # (silent from the start: the first-token bound is the one that runs out)
    idle_s = 0.5 if code == wire.TIMEOUT else 30.0
    engine = await started(
        server, model, idle_timeout_s=idle_s, first_token_timeout_s=idle_s, retry_s=1.0
    )
    made: list[int] = []
    try:
        with pytest.raises(EngineError) as raised:
            async with asyncio.timeout(SAFETY_S):
                async for step in engine.generate("outlasts", prompt, GREEDY):
                    made += step.token_ids
                    if then is not None:  # (the call streaming now has its fault already)
                        server.faults(**then)
    finally:
        await engine.close()
    assert raised.value.code == code
    assert len(made) == (3 if code == wire.CUT else 0)
    # asked again with a growing backoff within retry_s (1 s): a few calls, not a flood
    assert 2 <= len(server.calls()) - before <= 20
    server.faults(**NO_FAULTS)
    await eventually(lambda: server.held() == 0, "the server to let go of every call")


# -- refused for good: not asked again -------------------------------------------------


async def test_a_400_ends_with_upstream_rejected_and_is_not_asked_again(
    server: ServerProcess, engine: UpstreamEngine, prompt: list[int]
) -> None:
    before = len(server.calls())
    server.faults(refuse={"count": 1, "status": 400})
    error = await failure(engine, prompt, GREEDY)
    assert error.code == wire.REJECTED
    assert len(server.calls()) == before + 1
    # and one the server's engine refuses (an id out of the vocabulary): the same
    error = await failure(engine, [10**7], GREEDY)
    assert error.code == wire.REJECTED and "400" in str(error)
    assert len(server.calls()) == before + 2


# -- what cannot be continued exactly is not -------------------------------------------


PENALIZED = {
    "presence_penalty": SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=1.0),
    "frequency_penalty": SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=1.0),
    "structured": SamplingParams(
        max_tokens=16,
        temperature=0.0,
        structured=Structured(kind="json_schema", schema=json.dumps({"type": "object"})),
    ),
}


@pytest.mark.parametrize("under", list(PENALIZED))
async def test_a_penalized_or_structured_answer_cut_mid_answer_is_not_continued(
    server: ServerProcess, engine: UpstreamEngine, prompt: list[int], under: str
) -> None:
    params = PENALIZED[under]
    before = len(server.calls())
    server.faults(cut={"count": 1, "after": 3})
    made: list[int] = []
    with pytest.raises(EngineError) as raised:
        async with asyncio.timeout(SAFETY_S):
            async for step in engine.generate(f"penalized-{under}", prompt, params):
                made += step.token_ids
    assert raised.value.code == wire.CUT and len(made) == 3
    assert len(server.calls()) == before + 1  # not asked again
    # refused before its first id, it is asked again (nothing to continue yet)
    server.faults(refuse={"count": 1, "status": 503, "retry_after": "0"})
    steps = await run(engine, prompt, params)
    assert steps[-1].finished and len(server.calls()) == before + 3
    # and a takeover of it (ids made elsewhere) is refused before any call
    error = await failure_continuing(engine, prompt, params, made)
    assert error.code == "unsupported_continuation" and len(server.calls()) == before + 3


async def failure_continuing(
    engine: UpstreamEngine, prompt: list[int], params: SamplingParams, made: list[int]
) -> EngineError:
    with pytest.raises(EngineError) as raised:
        async with asyncio.timeout(SAFETY_S):
            async for _ in engine.generate("continuing", prompt, params, made):
                pass
    return raised.value


async def test_the_repetition_penalty_is_continued_exactly(
    server: ServerProcess, engine: UpstreamEngine, model: ModelInfo, prompt: list[int]
) -> None:
    """vLLM's repetition penalty counts prompt and output alike: the ids made so far sent
    as prompt are penalized the same, so a cut answer is continued greedy-exact."""
    params = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.5)
    want = await reference(server, model, params)
    server.faults(cut={"count": 1, "after": 5})
    assert ids_of(await run(engine, prompt, params)) == want


# -- the server killed (kill -9) and started again on its port --------------------------


@pytest.fixture
def own_server(tmp_path: Path, model_dir: Path) -> Iterator[ServerProcess]:
    """A server of the test's own, to kill."""
    pytest.importorskip("torch")
    server = ServerProcess(tmp_path, model_dir, engine="cpu")
    try:
        yield server.start()
    finally:
        server.stop()


async def test_a_server_killed_mid_answer_is_unavailable_until_back_then_continued(
    own_server: ServerProcess, model: ModelInfo, prompt: list[int]
) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0)
    want = await reference(own_server, model, params)
    engine = await started(own_server, model, probe_s=0.1, retry_s=240.0)  # (a safety net)
    try:
        assert engine.available
        steps = engine.generate("killed", prompt, params)
        got = [step async for step in _first(steps, 5)]
        own_server.kill()
        # nobody reads the broken stream meanwhile: the prober sees the server gone
        await eventually(lambda: not engine.available, "the engine to see the server gone")
        rest = asyncio.create_task(_rest(steps))  # (refused: it waits, within retry_s)
        await asyncio.to_thread(own_server.start)
        await eventually(lambda: engine.available, "the engine to see the server back")
        async with asyncio.timeout(SAFETY_S):
            got += await rest
        assert engine.available
        assert ids_of(got) == want and got[-1].finish_reason == "length"
        continued = own_server.calls()  # (the restarted server's calls: the continuation)
        assert len(continued) == 1 and continued[0]["prompt"] == prompt + want[:5]
    finally:
        await engine.close()


async def _first(steps: AsyncIterator[StepOutput], n: int) -> AsyncIterator[StepOutput]:
    for _ in range(n):
        yield await anext(steps)


async def _rest(steps: AsyncIterator[StepOutput]) -> list[StepOutput]:
    return [step async for step in steps]


# -- an abort closes the stream, and the server aborts its request --------------------


async def test_an_abort_mid_answer_ends_with_abort_and_the_server_lets_go(
    server: ServerProcess, engine: UpstreamEngine, prompt: list[int]
) -> None:
    steps: list[StepOutput] = []
    async with asyncio.timeout(SAFETY_S):
        async for step in engine.generate("aborted", prompt, SamplingParams(max_tokens=400)):
            steps.append(step)
            if len(steps) == 3:
                assert server.gauges()["running"] == 1  # (the gauge is real)
                await engine.abort("aborted")
    assert steps[-1].finished and steps[-1].finish_reason == "abort"
    assert len(steps) <= 3 + 3
    await eventually(lambda: server.held() == 0, "the server's running count to fall to 0")
