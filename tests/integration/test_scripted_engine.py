"""The scripted engine (tests and benchmarks) with the real tokenizer."""

from __future__ import annotations

import asyncio

from service.tokenize import ModelInfo
from service.stream.params import SamplingParams
from workers.engines.scripted import ScriptedEngine


async def test_abort_lands_inside_a_step_not_after_it(model: ModelInfo) -> None:
    """A step takes 100 s here; abort must end the request now (the abort latency the
    benchmark measures is lastevent's, not a wait for the engine's next step)."""
    engine = ScriptedEngine(model, tokens_per_s=0.01, text="one two three")
    params = SamplingParams(max_tokens=10)
    gen = engine.generate("r1", model.encode("hi"), params)
    step = asyncio.ensure_future(anext(gen))
    await asyncio.sleep(0.05)
    assert not step.done()  # sleeping through its first step
    await engine.abort("r1")
    async with asyncio.timeout(5):
        out = await step
    assert out.finished and out.finish_reason == "abort" and out.token_ids == []
    await gen.aclose()
    assert "r1" not in engine.running


async def test_unaborted_request_yields_its_script_then_eos(model: ModelInfo) -> None:
    engine = ScriptedEngine(model, tokens_per_s=1000, text="one two three")
    params = SamplingParams(max_tokens=100)
    outs = [o async for o in engine.generate("r2", model.encode("hi"), params)]
    ids = [t for o in outs for t in o.token_ids]
    assert ids[:-1] == model.encode("one two three") and ids[-1] in model.eos_token_ids
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
