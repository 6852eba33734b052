"""The real vLLM engine (CPU build), in process: abort frees it, batching, lengths."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio
from redis.asyncio import Redis

from service.store.keys import Keys
from service.store.queue import Job, RequestQueue
from service.store.log import RedisLog
from service.settings import Settings
from service.stream.events import Created, Delta, End
from service.tokenize import ModelInfo
from service.stream.params import SamplingParams

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.filterwarnings("ignore"),  # vLLM's own deprecation noise
    pytest.mark.asyncio(loop_scope="module"),
]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model_dir: Path) -> AsyncIterator[object]:
    from workers.engines.vllm import VllmConfig, VllmEngine

    eng = VllmEngine(VllmConfig(model_dir=model_dir, dtype="float32", enforce_eager=True,
                                kv_cache_gb=1, max_model_len=2048))
    await eng.start()
    yield eng
    await eng.close()


def chat_ids(model: ModelInfo, text: str) -> list[int]:
    return model.encode(model.render_chat([{"role": "user", "content": text}]))


async def test_max_tokens_exactly(engine, model: ModelInfo) -> None:  # type: ignore[no-untyped-def]
    params = SamplingParams(max_tokens=7, temperature=0.0)
    outs = [o async for o in engine.generate("len-" + uuid.uuid4().hex, chat_ids(model, "Count to fifty."), params)]
    assert sum(len(o.token_ids) for o in outs) == 7
    assert outs[-1].finished and outs[-1].finish_reason == "length"
    assert all(len(o.token_ids) == 1 for o in outs)  # one token per engine step, DELTA kind


async def test_abort_mid_generation_frees_the_request(engine, model: ModelInfo) -> None:  # type: ignore[no-untyped-def]
    rid = "abort-" + uuid.uuid4().hex
    params = SamplingParams(max_tokens=400, temperature=0.0)  # no EOS: it would run on
    seen = 0
    last = None
    aborted = False
    async for out in engine.generate(rid, chat_ids(model, "Write a long story."), params):
        seen += len(out.token_ids)
        last = out
        if seen >= 5 and not aborted:
            assert engine.num_unfinished_requests() == 1
            await engine.abort(rid)
            aborted = True
    assert last is not None and last.finished and last.finish_reason == "abort"
    assert seen < 20  # stopped within a step or two of the abort
    assert engine.num_unfinished_requests() == 0  # vLLM's own count: the request is freed


async def test_concurrent_requests_share_engine_steps(engine, model: ModelInfo) -> None:  # type: ignore[no-untyped-def]
    order: list[str] = []

    async def run(label: str) -> None:
        params = SamplingParams(max_tokens=12, temperature=0.0)
        async for out in engine.generate(f"{label}-{uuid.uuid4().hex}", chat_ids(model, "Hi " + label), params):
            if out.token_ids:
                order.append(label)

    await asyncio.gather(run("a"), run("b"))
    switches = sum(1 for x, y in zip(order, order[1:], strict=False) if x != y)
    assert order.count("a") >= 8 and order.count("b") >= 8  # 12, or fewer if EOS came first
    assert switches >= 10  # interleaved step by step, not one after the other


async def test_runner_appends_one_step_of_all_requests_in_one_round_trip(
    engine, model: ModelInfo, redis_url: str, key_prefix: str, tmp_path: Path  # type: ignore[no-untyped-def]
) -> None:
    from workers.runner import Runner

    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, data_dir=tmp_path,
                        worker_concurrency=8, recorder_in_worker=False)
    redis = Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    log, queue = RedisLog(redis, keys), RequestQueue(redis, keys)
    runner = Runner(settings, redis, engine, model)
    task = asyncio.create_task(runner.run())
    try:
        rids = [f"chatcmpl-{uuid.uuid4().hex}" for _ in range(6)]
        for rid in rids:
            ids = chat_ids(model, "Tell me about the sea.")
            await log.create(rid, Created(kind="chat", model="m", created=0, prompt_tokens=len(ids)),
                             600, detached=True)
            await queue.enqueue(Job(request_id=rid, prompt_token_ids=ids,
                                    params=SamplingParams(max_tokens=24, temperature=0.0),
                                    deadline_unix_s=time.time() + 120))
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            lasts = [await log.last(r) for r in rids]
            if all(x is not None and isinstance(x[1], End) for x in lasts):
                break
            await asyncio.sleep(0.1)
        logs = [await log.read(r) for r in rids]
        deltas = sum(1 for entries in logs for _i, e in entries if isinstance(e, Delta))
        assert deltas >= 6 * 10
        ratio = runner.batcher.appends / runner.batcher.round_trips
        print(f"\nvLLM runner: {runner.batcher.appends} appends in {runner.batcher.round_trips} "
              f"round trips ({ratio:.1f} per trip) for 6 concurrent requests")
        assert ratio >= 3  # one step of all running requests goes out together
    finally:
        runner.stop()
        await asyncio.wait_for(task, 30)
        await redis.delete(*[k for r in rids for k in (keys.log(r), keys.meta(r))], keys.queue)
        await redis.aclose()
