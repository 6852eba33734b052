"""The CPU engine's continuous batching, on the real model: a request decoded beside
others gets, token for token, what it gets alone (greedy; a seeded sample; penalties,
bias, logprobs; structured output); requests join and leave between steps; an abort
frees its slot; a long prompt joins a chunk at a time; ``max_batch`` bounds the batch.

Nothing here is timed: each assertion is on the steps and on the order in which two
requests' steps arrived (``Order``); ``SAFETY_S`` only keeps a hang from lasting."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from service.stream.params import SamplingParams, Structured
from service.tokenize import ModelInfo
from tests.engine_contract import (
    CITY_SCHEMA,
    JSON_QUESTION,
    LONG,
    OTHER,
    SAFETY_S,
    SHORT,
    chat_ids,
    ids_of,
    new_id,
)
from workers.engines.base import StepOutput

pytest.importorskip("torch")
pytest.importorskip("transformers")

LONG_RUN = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def new_engine(model_dir: Path, model: ModelInfo, **kw: Any) -> Any:
    from workers.engines.cpu import CpuEngine

    return CpuEngine(model_dir, eos_token_ids=model.eos_token_ids, threads=os.cpu_count(), **kw)


@contextlib.asynccontextmanager
async def started(model_dir: Path, model: ModelInfo, **kw: Any) -> AsyncIterator[Any]:
    engine = new_engine(model_dir, model, **kw)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()


@pytest.fixture(scope="module")
def engine(model_dir: Path, model: ModelInfo) -> Iterator[Any]:
    """One loaded engine for the module (it keeps no event-loop state between requests)."""
    shared = new_engine(model_dir, model, max_batch=8, prefill_chunk=16)
    asyncio.run(shared.start())
    yield shared
    asyncio.run(shared.close())


class Order:
    """Every step of several requests, in the order they arrived (labels)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def run(
        self,
        engine: Any,
        label: str,
        prompt: list[int],
        params: SamplingParams,
        *,
        after: tuple[str, int] | None = None,
        abort_after: int | None = None,
    ) -> list[StepOutput]:
        """``label``'s steps; it starts once ``after`` = (label, n) has had n steps, and is
        aborted after ``abort_after`` of its own."""
        if after is not None:
            while self.seen.count(after[0]) < after[1]:
                await asyncio.sleep(0.001)
        rid = new_id(label)
        steps = []
        async for step in engine.generate(rid, prompt, params):
            self.seen.append(label)
            steps.append(step)
            if abort_after is not None and len(steps) == abort_after:
                await engine.abort(rid)
        return steps

    def before(self, label: str, other: str) -> int:
        """How many of ``other``'s steps came before ``label``'s first."""
        return self.seen[: self.seen.index(label)].count(other)


async def alone(engine: Any, prompt: list[int], params: SamplingParams) -> list[StepOutput]:
    async with asyncio.timeout(SAFETY_S):
        return [s async for s in engine.generate(new_id("alone"), prompt, params)]


async def together(*runs: Any) -> list[list[StepOutput]]:
    async with asyncio.timeout(SAFETY_S):
        return list(await asyncio.gather(*runs))


@pytest.fixture
def prompts(model: ModelInfo) -> dict[str, list[int]]:
    questions = {"long": LONG, "short": SHORT, "other": OTHER, "json": JSON_QUESTION}
    return {name: chat_ids(model, q) for name, q in questions.items()}


async def test_requests_joining_mid_batch_get_what_they_get_alone(
    engine: Any, prompts: dict[str, list[int]]
) -> None:
    short = SamplingParams(max_tokens=24, temperature=0.0)
    want = {
        "a": await alone(engine, prompts["long"], LONG_RUN),
        "b": await alone(engine, prompts["short"], short),
        "c": await alone(engine, prompts["other"], short),
    }
    order = Order()
    got = await together(
        order.run(engine, "a", prompts["long"], LONG_RUN),
        order.run(engine, "b", prompts["short"], short, after=("a", 5)),
        order.run(engine, "c", prompts["other"], short, after=("b", 3)),
    )
    for (label, expected), steps in zip(want.items(), got, strict=True):
        assert ids_of(steps) == ids_of(expected), label
        assert steps[-1].finish_reason == expected[-1].finish_reason, label
    # they ran together: each joined while ``a`` was still running (one at a time, ``b``
    # would have come after all of ``a``)
    assert order.before("b", "a") < len(got[0]) and order.before("c", "a") < len(got[0])


async def test_an_abort_mid_batch_frees_its_slot_and_changes_no_other_answer(
    model_dir: Path, model: ModelInfo, prompts: dict[str, list[int]]
) -> None:
    async with started(model_dir, model, max_batch=2, prefill_chunk=64) as small:
        want = await alone(small, prompts["long"], LONG_RUN)
        order = Order()
        got = await together(
            order.run(small, "a", prompts["long"], LONG_RUN),
            order.run(small, "b", prompts["short"], LONG_RUN, after=("a", 2), abort_after=4),
            # a third waits for a slot: the abort of ``b`` frees one before ``a`` ends
            order.run(small, "c", prompts["other"], LONG_RUN, after=("b", 1)),
        )
        assert ids_of(got[0]) == ids_of(want)
        assert got[1][-1].finish_reason == "abort" and len(got[1]) <= 4 + 3
        assert got[2][-1].finish_reason == "length"
        assert order.before("c", "a") < len(got[0]), "c waited for a, not for b's slot"
        assert order.before("c", "b") >= 4, "c started before b had a slot to give"


async def test_mixed_sampling_and_structured_output_in_one_batch(
    engine: Any, model: ModelInfo, prompts: dict[str, list[int]]
) -> None:
    kinds = {
        "greedy": (prompts["long"], LONG_RUN),
        "seeded": (
            prompts["short"],
            SamplingParams(max_tokens=24, temperature=0.9, top_p=0.9, top_k=40, seed=7),
        ),
        "penalised": (
            prompts["other"],
            SamplingParams(
                max_tokens=24, temperature=0.0, repetition_penalty=1.3, frequency_penalty=0.5
            ),
        ),
        "biased": (
            prompts["short"],
            SamplingParams(max_tokens=8, temperature=0.0, logit_bias={42: 100.0}, logprobs=2),
        ),
        "json": (
            prompts["json"],
            SamplingParams(
                max_tokens=48,
                temperature=0.0,
                structured=Structured(kind="json_schema", schema=CITY_SCHEMA),
            ),
        ),
    }
    want = {k: await alone(engine, p, params) for k, (p, params) in kinds.items()}
    order = Order()
    runs = [order.run(engine, k, p, params) for k, (p, params) in kinds.items()]
    got = dict(zip(kinds, await together(*runs), strict=True))
    for kind in kinds:
        assert ids_of(got[kind]) == ids_of(want[kind]), kind
    steps = got["biased"]
    assert all(s.logprobs is not None and len(s.logprobs) == 1 for s in steps[:-1])
    # the same alternatives; their logprobs within float32 noise of the lone run's (a
    # batch of rows is one matrix product, its sums in another order)
    for step, lone in zip(steps, want["biased"], strict=True):
        for mine, its in zip(step.logprobs or (), lone.logprobs or (), strict=True):
            assert [t for t, _ in mine.top] == [t for t, _ in its.top]
            assert math.isclose(mine.logprob, its.logprob, abs_tol=1e-4)
    assert set(ids_of(steps)) == {42}  # its bias, and nobody else's (they are as alone)
    # ...and the structured one is valid JSON of its schema
    assert "city" in json.loads(model.decode(ids_of(got["json"])))
    assert len(set(order.seen[:5])) > 1, "the first steps were not interleaved"


async def test_a_long_prompt_joins_a_chunk_at_a_time(
    model_dir: Path, model: ModelInfo, prompts: dict[str, list[int]]
) -> None:
    """With 16-token chunks, a 300-token prompt takes ~19 steps to prefill: the running
    request keeps getting tokens meanwhile (in one piece it would get one at most)."""
    long_prompt = chat_ids(model, " ".join([LONG] * 16))
    assert len(long_prompt) > 250
    async with started(model_dir, model, max_batch=4, prefill_chunk=16) as small:
        order = Order()
        await together(
            order.run(small, "a", prompts["long"], LONG_RUN),
            order.run(small, "b", long_prompt, SamplingParams(max_tokens=2), after=("a", 2)),
        )
        during = order.before("b", "a") - 2
        assert during >= 8, f"the running request got {during} tokens during the prefill"


async def test_prompts_that_fit_a_chunk_are_prefilled_together(
    model_dir: Path, model: ModelInfo, prompts: dict[str, list[int]]
) -> None:
    """Six short prompts arriving together: fewer forward passes than prompts (several
    in one, left-padded), and each answer is still the one it gets alone."""
    short = SamplingParams(max_tokens=12, temperature=0.0)
    asked = [prompts[k] for k in ("long", "short", "other", "json")] + [
        chat_ids(model, "Name a colour."),
        chat_ids(model, "Say hello in French."),
    ]
    async with started(model_dir, model, max_batch=8, prefill_chunk=256) as big:
        want = [await alone(big, p, short) for p in asked]
        before = big._scheduler.prefill_passes
        order = Order()
        got = await together(*(order.run(big, str(i), p, short) for i, p in enumerate(asked)))
        passes = big._scheduler.prefill_passes - before
    assert [ids_of(g) for g in got] == [ids_of(w) for w in want]
    assert passes < len(asked), f"{passes} prefill passes for {len(asked)} prompts"
