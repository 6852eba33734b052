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
from service.stream.params import SamplingParams
from service.tokenize import ModelInfo
from tests.engine_contract import chat_ids

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
        await redis.delete(*[k for r in rids for k in (keys.log(r), keys.meta(r))], keys.queue)
        await redis.aclose()
