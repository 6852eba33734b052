"""The scripted engine (tests and benchmarks) with the real tokenizer: what is its own
(pacing, ``text=``, fault injection); what every engine does is the engine contract
(tests/engine_contract.py, run by test_engine_contract.py)."""

from __future__ import annotations

import asyncio

import pytest

from service.stream.params import SamplingParams
from service.tokenize import ModelInfo
from workers.engines.base import EngineError
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


async def test_fault_injection_fails_or_crashes_after_that_many_tokens(model: ModelInfo) -> None:
    """``fail_after`` is an engine error (the request ends errored); ``crash_after`` is
    not one (a bug, which the worker must survive too)."""
    params = SamplingParams(max_tokens=100)
    seen: list[int] = []
    failing = ScriptedEngine(model, tokens_per_s=1000, text="one two three", fail_after=2)
    with pytest.raises(EngineError) as failed:
        async for out in failing.generate("f1", model.encode("hi"), params):
            seen.extend(out.token_ids)
    assert seen == model.encode("one two three")[:2] and failed.value.code == "engine_failure"

    crashing = ScriptedEngine(model, tokens_per_s=1000, text="one two three", crash_after=1)
    with pytest.raises(RuntimeError) as crashed:
        async for _out in crashing.generate("f2", model.encode("hi"), params):
            pass
    assert not isinstance(crashed.value, EngineError)
    assert not failing.running and not crashing.running


async def test_an_eos_inside_the_echoed_text_ends_the_request(model: ModelInfo) -> None:
    """The contract: an engine stops on its EOS ids, and the EOS is its last id. A text
    prompt may carry one (the tokenizer parses ``<|im_end|>`` in a completions prompt);
    the engine once ended a request by the script's length instead, and ran on past it."""
    engine = ScriptedEngine(model, tokens_per_s=1000)
    prompt = model.encode("one<|im_end|>two")
    assert model.eos_token_ids[0] in prompt
    async with asyncio.timeout(30):
        outs = [o async for o in engine.generate("r3", prompt, SamplingParams(max_tokens=10))]
    ids = [t for o in outs for t in o.token_ids]
    assert ids == model.encode("one<|im_end|>")
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
