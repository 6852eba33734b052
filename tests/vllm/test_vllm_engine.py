"""The real vLLM engine (CPU build), in process: what is vLLM's own (its request count
after an abort, step-by-step batching, the runner over it). What every engine does is
the engine contract (tests/engine_contract.py), run by test_vllm_contract.py."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from service.settings import Settings
from service.store.keys import Keys
from service.store.log import RedisLog
from service.store.queue import Job, RequestQueue
from service.stream.events import Created, Delta, End
from service.stream.params import SamplingParams, Structured
from service.tokenize import ModelInfo
from tests.engine_contract import chat_ids
from workers.engines.base import EngineError

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore"),  # vLLM's own deprecation noise
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[Any]:
    from workers.engines.vllm import VllmConfig, VllmEngine

    config = VllmConfig(
        model_dir=model_dir, dtype="float32", enforce_eager=True, kv_cache_gb=1, max_model_len=2048
    )
    eng = VllmEngine(config)
    await eng.start()
    yield eng
    await eng.close()


async def test_sampling_fields_map_onto_vllms(model_dir: Path) -> None:
    """What ``generate`` hands vLLM (no engine needed): a fresh request maps field for
    field; a continuation shortens max_tokens and min_tokens by the handed-over ids and
    gives what counts output ids (presence, frequency, the grammar) to the processor,
    which only vLLM's V1 model runner loads (V2 refuses such a continuation)."""
    from workers.engines.vllm import _CONTINUATION, VllmConfig, VllmEngine

    engine = VllmEngine(VllmConfig(model_dir=model_dir, eos_token_ids=(2,)))
    params = SamplingParams(
        max_tokens=20,
        temperature=0.5,
        top_k=-1,
        min_p=0.1,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        repetition_penalty=1.1,
        min_tokens=5,
        logit_bias={7: 3.0},
        stop_token_ids=(9,),
        logprobs=3,
        structured=Structured(kind="json_object"),
    )
    fresh = engine._sampling(params, (), 20)
    assert (fresh.top_k, fresh.min_p, fresh.min_tokens, fresh.logprobs) == (0, 0.1, 5, 3)
    assert (fresh.presence_penalty, fresh.frequency_penalty) == (0.5, 0.25)
    assert fresh.repetition_penalty == 1.1 and fresh.logit_bias == {7: 3.0}
    assert fresh.stop_token_ids == [9, 2] and not fresh.ignore_eos and not fresh.detokenize
    assert fresh.structured_outputs.json_object and fresh.extra_args is None

    later = engine._sampling(params, (11, 12, 13), 17)
    assert (later.max_tokens, later.min_tokens) == (17, 2)
    assert (later.presence_penalty, later.frequency_penalty, later.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert later.structured_outputs is None
    state = later.extra_args[_CONTINUATION]
    assert state["generated"] == [11, 12, 13] and state["kind"] == "json_object"
    assert (state["presence_penalty"], state["repetition_penalty"]) == (0.5, 1.1)

    plain = SamplingParams(max_tokens=4, ignore_eos=True, stop_token_ids=(9,))
    assert engine._sampling(plain, (11,), 3).extra_args is None  # nothing counts output
    assert engine._sampling(plain, (), 4).stop_token_ids == [9]  # the EOS does not end it

    engine._continues = False  # vLLM's V2 model runner: no ContinuationProcessor there
    with pytest.raises(EngineError) as refused:
        engine._sampling(params, (11, 12, 13), 17)
    assert refused.value.code == "unsupported_continuation"
    assert engine._sampling(params, (), 20).structured_outputs.json_object  # fresh: all there


async def test_one_token_per_engine_step(engine: Any, model: ModelInfo) -> None:
    """DELTA outputs: a consumer that keeps up sees each engine step's one new token."""
    params = SamplingParams(max_tokens=7, temperature=0.0)
    prompt = chat_ids(model, "Count to fifty.")
    async with asyncio.timeout(60):
        outs = [o async for o in engine.generate(f"len-{uuid.uuid4().hex}", prompt, params)]
    assert [len(o.token_ids) for o in outs] == [1] * 7


async def test_abort_mid_generation_frees_the_request_in_vllm(
    engine: Any, model: ModelInfo
) -> None:
    """The stream ending ``abort`` is the contract's; here: vLLM itself lets go of it."""
    rid = f"abort-{uuid.uuid4().hex}"
    params = SamplingParams(max_tokens=400, temperature=0.0)  # no EOS: it would run on
    seen = 0
    aborted = False
    async with asyncio.timeout(60):
        async for out in engine.generate(rid, chat_ids(model, "Write a long story."), params):
            seen += len(out.token_ids)
            if seen >= 5 and not aborted:
                assert engine.num_unfinished_requests() == 1
                await engine.abort(rid)
                aborted = True
    assert aborted
    assert engine.num_unfinished_requests() == 0  # vLLM's own count: the request is freed


async def test_concurrent_requests_share_engine_steps(engine: Any, model: ModelInfo) -> None:
    order: list[str] = []

    async def run(label: str) -> None:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        prompt = chat_ids(model, "Hi " + label)
        async for out in engine.generate(f"{label}-{uuid.uuid4().hex}", prompt, params):
            if out.token_ids:
                order.append(label)

    async with asyncio.timeout(60):
        await asyncio.gather(run("a"), run("b"))
    switches = sum(1 for x, y in itertools.pairwise(order) if x != y)
    assert order.count("a") >= 8 and order.count("b") >= 8  # 12, or fewer if EOS came first
    assert switches >= 10  # interleaved step by step, not one after the other


async def test_runner_appends_one_step_of_all_requests_in_one_round_trip(
    engine: Any, model: ModelInfo, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    from workers.runner import Runner

    settings = Settings(
        durability="memory",
        redis_url=redis_url,
        key_prefix=key_prefix,
        data_dir=tmp_path,
        worker_concurrency=8,
        recorder_in_worker=False,
    )
    redis = Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    log, queue = RedisLog(redis, keys), RequestQueue(redis, keys)
    runner = Runner(settings, redis, engine, model)
    task = asyncio.create_task(runner.run())
    rids = [f"chatcmpl-{uuid.uuid4().hex}" for _ in range(6)]
    try:
        for rid in rids:
            ids = chat_ids(model, "Tell me about the sea.")
            created = Created(kind="chat", model="m", created=0, prompt_tokens=len(ids))
            await log.create(rid, created, 600, detached=True)
            params = SamplingParams(max_tokens=24, temperature=0.0)
            job = Job(
                request_id=rid,
                prompt_token_ids=ids,
                params=params,
                deadline_unix_s=time.time() + 120,
            )
            await queue.enqueue(job)
        deadline = time.monotonic() + 120  # a hang guard; the assertions are on the log
        while time.monotonic() < deadline:
            lasts = [await log.last(r) for r in rids]
            if all(x is not None and isinstance(x[1], End) for x in lasts):
                break
            await asyncio.sleep(0.1)
        logs = [await log.read(r) for r in rids]
        deltas = sum(1 for entries in logs for _i, e in entries if isinstance(e, Delta))
        assert deltas >= 6 * 10
        ratio = runner.batcher.appends / runner.batcher.round_trips
        print(
            f"\nvLLM runner: {runner.batcher.appends} appends in {runner.batcher.round_trips} "
            f"round trips ({ratio:.1f} per trip) for 6 concurrent requests"
        )
        assert ratio >= 3  # one step of all running requests goes out together
    finally:
        runner.stop()
        await asyncio.wait_for(task, 30)
        await redis.delete(*[k for r in rids for k in (keys.log(r), keys.meta(r))], keys.queue(0))
        await redis.aclose()
