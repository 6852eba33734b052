"""The engine contract: what every engine (``workers.engines.base.Engine``) must do.

Written once, run against every backend (as vercel/resumable-stream's exported
``resumableStreamTests(factory)``): a test module subclasses ``EngineContract`` as
``Test<Engine>Contract`` and provides the fixtures

- ``contract_engine``: a started engine built with the model's EOS ids (it may be
  shared between the tests: every request uses its own id);
- ``contract_cold_engine``: the same engine built but never started;
- ``model``: the ``ModelInfo`` (tests/conftest.py has it).

``skips`` names the cases an engine cannot be put through, with the reason (a
case is its test's name without ``test_``, plus ``[param]`` for one parameter);
``xfails`` the cases it fails although it should (an engine bug, reported), which
run as ``xfail(strict=True)``; ``held(engine)`` is how many requests the engine
still holds, where it can say. Nothing here times anything: the assertions are on
the steps; ``SAFETY_S`` only keeps a broken engine from hanging the suite.

The cases:

- the steps carry only the new ids and only the last step is ``finished``;
- ``max_tokens`` is exact and ends with ``length``;
- the EOS ends with ``stop``, is counted in the ids (and in ``max_tokens``), and is
  the last id;
- ``temperature=0`` is deterministic; a seeded sample is reproducible;
- an abort mid-generation ends the stream within a few steps with ``abort``, and
  the engine serves the next request; aborting an unknown or finished request is
  harmless;
- a consumer that closes the generator frees the engine for the next request;
- two concurrent requests both complete with their own outputs (a serial engine
  may run the second after the first);
- images for an engine whose model does not see (``images`` False) raise ``EngineError``;
- a prompt the engine cannot run (out-of-vocabulary id, empty) raises
  ``EngineError``, and so does ``generate`` before ``start``; the engine serves the
  next request afterwards;
- the sampling fields: logprobs come only when asked, one per id, ``k`` alternatives
  best first (greedy: the sampled id is the best; its logprob is its alternative's),
  and asking for them changes no id; a ``stop_token_ids`` id ends the request
  (``stop``, the last id); ``ignore_eos`` runs to ``max_tokens`` past the EOS (stop
  ids still end it); ``min_tokens`` masks the EOS and stop ids before that many; a
  large ``logit_bias`` decides a greedy answer; ``top_k=1`` or ``min_p=1`` sampling is
  greedy; the penalties change a greedy answer; structured output is valid JSON (of
  the schema); and a continuation under penalties or structured output is the rest
  of the uninterrupted run.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any, ClassVar

import pytest

from service.stream.params import SamplingParams, Structured
from service.tokenize import ModelInfo
from workers.engines.base import Engine, EngineError, StepOutput

SAFETY_S = 60.0  # a hang guard only, never an assertion about speed

# A request with a long answer (no EOS within the few tokens asked for) and two with
# short ones: SmolLM2-135M-Instruct answers them greedily in under 20 tokens and EOS.
# The scripted engine echoes the question, so all of them hold for it as well.
LONG = "Write a long story about an old lighthouse keeper, his dog and the winter sea."
SHORT = "What is the capital of France?"
OTHER = "What is 2+2?"
EOS_WITHIN = 64  # the short answers end before this many tokens
ABORT_AFTER = 3  # steps read before the abort
ABORT_SLACK = 3  # steps allowed after the abort, the abort step included

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
# a 1x1 PNG: images for an engine whose model does not see
PNG_1X1 = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)

# A question SmolLM2-135M-Instruct answers, under the schema, with a short JSON object
# and EOS; and the schema (the scripted engine's script is not JSON: it skips those).
JSON_QUESTION = "What is the capital of France? Answer in JSON with the key city."
CITY_SCHEMA = json.dumps(
    {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
)
JSON_MAX_TOKENS = 48
STRUCTURED = {
    "json_schema": Structured(kind="json_schema", schema=CITY_SCHEMA),
    "json_object": Structured(kind="json_object"),
}
PENALTIES = {
    "presence_penalty": {"presence_penalty": 2.0},
    "frequency_penalty": {"frequency_penalty": 2.0},
    "repetition_penalty": {"repetition_penalty": 1.5},
}


def chat_ids(model: ModelInfo, question: str) -> list[int]:
    """The prompt ids the API sends for a one-message chat."""
    return model.encode(model.render_chat([{"role": "user", "content": question}]))


def new_id(label: str) -> str:
    return f"contract-{label}-{uuid.uuid4().hex[:8]}"


async def collect(
    engine: Engine,
    prompt: list[int],
    params: SamplingParams,
    label: str = "req",
    generated: list[int] | None = None,
) -> list[StepOutput]:
    async with asyncio.timeout(SAFETY_S):
        steps = engine.generate(new_id(label), prompt, params, generated or ())
        return [step async for step in steps]


def ids_of(steps: list[StepOutput]) -> list[int]:
    return [t for step in steps for t in step.token_ids]


def assert_well_formed(steps: list[StepOutput]) -> None:
    """Ids are ints; only the last step is finished, and only it has a reason."""
    assert steps, "generate yielded nothing"
    for step in steps:
        assert isinstance(step.token_ids, list)
        assert all(isinstance(t, int) for t in step.token_ids)
    assert [s.finished for s in steps] == [False] * (len(steps) - 1) + [True]
    assert [s.finish_reason for s in steps[:-1]] == [None] * (len(steps) - 1)
    assert steps[-1].finish_reason in ("stop", "length", "abort")


class EngineContract:
    """Subclass as ``Test<Engine>Contract``; see the module docstring for the fixtures."""

    skips: ClassVar[Mapping[str, str]] = {}  # case name -> why this engine cannot run it
    xfails: ClassVar[Mapping[str, str]] = {}  # case name -> the engine bug it shows

    def held(self, engine: Any) -> int | None:
        """How many requests ``engine`` still holds; ``None``: it cannot say."""
        return None

    @pytest.fixture(autouse=True)
    def _contract_case(self, request: pytest.FixtureRequest) -> None:
        """A case is named without ``test_``, with or without its parameter id."""
        names = {request.node.originalname, request.node.name}
        for case in (name.removeprefix("test_") for name in names):
            if case in self.skips:
                pytest.skip(self.skips[case])
            if case in self.xfails:
                request.applymarker(pytest.mark.xfail(reason=self.xfails[case], strict=True))

    async def _assert_released(self, engine: Any) -> None:
        """Wait until the engine holds no request (an engine may let go a step later)."""
        if self.held(engine) is None:
            return
        async with asyncio.timeout(SAFETY_S):
            while self.held(engine):
                await asyncio.sleep(0.01)

    # -- steps, lengths, EOS ---------------------------------------------------------

    async def test_steps_carry_only_new_ids_and_the_last_is_finished(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        prompt = chat_ids(model, LONG)
        steps = await collect(contract_engine, prompt, GREEDY, "delta")
        assert_well_formed(steps)
        # deltas: the ids add up to max_tokens (cumulative outputs would add up to more)
        assert len(ids_of(steps)) == GREEDY.max_tokens
        assert steps[-1].finish_reason == "length"
        # and they are the text itself: a shorter request is a prefix of it
        half = await collect(contract_engine, prompt, SamplingParams(max_tokens=4, temperature=0))
        assert ids_of(half) == ids_of(steps)[:4]

    @pytest.mark.parametrize("max_tokens", [1, 5])
    async def test_max_tokens_is_exact_and_ends_with_length(
        self, contract_engine: Engine, model: ModelInfo, max_tokens: int
    ) -> None:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        steps = await collect(contract_engine, chat_ids(model, LONG), params, "length")
        assert_well_formed(steps)
        assert len(ids_of(steps)) == max_tokens
        assert steps[-1].finish_reason == "length"

    async def test_eos_ends_with_stop_and_is_the_last_id(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        params = SamplingParams(max_tokens=EOS_WITHIN, temperature=0.0)
        steps = await collect(contract_engine, chat_ids(model, SHORT), params, "eos")
        assert_well_formed(steps)
        ids = ids_of(steps)
        assert steps[-1].finish_reason == "stop"
        assert ids and ids[-1] in model.eos_token_ids  # counted: the EOS is in the output
        assert not set(ids[:-1]) & set(model.eos_token_ids)  # and nothing follows it
        assert len(ids) <= EOS_WITHIN

    async def test_eos_on_the_last_allowed_token_is_stop(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        """The EOS counts towards ``max_tokens``: with room for exactly the answer and its
        EOS the request still ends ``stop``; with one less it ends ``length`` before it."""
        prompt = chat_ids(model, SHORT)
        full = ids_of(
            await collect(
                contract_engine, prompt, SamplingParams(max_tokens=EOS_WITHIN, temperature=0.0)
            )
        )
        assert full and full[-1] in model.eos_token_ids
        exact = await collect(
            contract_engine, prompt, SamplingParams(max_tokens=len(full), temperature=0.0)
        )
        assert ids_of(exact) == full and exact[-1].finish_reason == "stop"
        if len(full) > 1:
            short = await collect(
                contract_engine, prompt, SamplingParams(max_tokens=len(full) - 1, temperature=0.0)
            )
            assert ids_of(short) == full[:-1] and short[-1].finish_reason == "length"

    # -- continuation (a takeover) ----------------------------------------------------

    @pytest.mark.parametrize("cut", [1, 5])
    async def test_a_continuation_is_the_rest_of_an_uninterrupted_run(
        self, contract_engine: Engine, model: ModelInfo, cut: int
    ) -> None:
        """``generated`` = the first ids of a greedy run: the engine makes the rest of it,
        and ``max_tokens`` counts the ids it was given (it ends ``length`` in the same place)."""
        params = SamplingParams(max_tokens=10, temperature=0.0)
        prompt = chat_ids(model, LONG)
        whole = ids_of(await collect(contract_engine, prompt, params, "whole"))
        rest = await collect(contract_engine, prompt, params, "rest", whole[:cut])
        assert_well_formed(rest)
        assert ids_of(rest) == whole[cut:]
        assert rest[-1].finish_reason == "length"

    async def test_a_continuation_up_to_the_eos(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        params = SamplingParams(max_tokens=EOS_WITHIN, temperature=0.0)
        prompt = chat_ids(model, SHORT)
        whole = ids_of(await collect(contract_engine, prompt, params, "whole"))
        assert whole[-1] in model.eos_token_ids
        rest = await collect(contract_engine, prompt, params, "rest", whole[:-2])
        assert ids_of(rest) == whole[-2:] and rest[-1].finish_reason == "stop"

    async def test_a_continuation_with_no_tokens_left_ends_with_length(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        params = SamplingParams(max_tokens=3, temperature=0.0)
        prompt = chat_ids(model, LONG)
        whole = ids_of(await collect(contract_engine, prompt, params, "whole"))
        rest = await collect(contract_engine, prompt, params, "rest", whole)
        assert ids_of(rest) == [] and rest[-1].finish_reason == "length"

    # -- determinism -----------------------------------------------------------------

    async def test_greedy_is_deterministic(self, contract_engine: Engine, model: ModelInfo) -> None:
        prompt = chat_ids(model, SHORT)
        params = SamplingParams(max_tokens=12, temperature=0.0)
        first = await collect(contract_engine, prompt, params, "greedy")
        second = await collect(contract_engine, prompt, params, "greedy")
        assert ids_of(first) and ids_of(first) == ids_of(second)
        assert first[-1].finish_reason == second[-1].finish_reason

    async def test_seeded_sampling_is_reproducible(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        prompt = chat_ids(model, LONG)
        params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=1234)
        first = await collect(contract_engine, prompt, params, "seed")
        second = await collect(contract_engine, prompt, params, "seed")
        assert ids_of(first) and ids_of(first) == ids_of(second)

    # -- abort and walking away ------------------------------------------------------

    async def test_abort_mid_generation_ends_promptly_then_serves_the_next(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        rid = new_id("abort")
        prompt = chat_ids(model, LONG)
        steps: list[StepOutput] = []
        after_abort = 0
        async with asyncio.timeout(SAFETY_S):
            # far more than it gets to: only the abort ends this one
            async for step in contract_engine.generate(
                rid, prompt, SamplingParams(max_tokens=400, temperature=0.0)
            ):
                steps.append(step)
                if len(steps) == ABORT_AFTER:
                    assert not step.finished
                    await contract_engine.abort(rid)
                elif len(steps) > ABORT_AFTER:
                    after_abort += 1
        assert_well_formed(steps)
        assert steps[-1].finish_reason == "abort"
        assert 1 <= after_abort <= ABORT_SLACK
        await self._assert_released(contract_engine)

        follow_up = await collect(contract_engine, prompt, SamplingParams(max_tokens=3), "next")
        assert len(ids_of(follow_up)) == 3 and follow_up[-1].finish_reason == "length"

    async def test_abort_of_an_unknown_or_finished_request_is_harmless(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        await contract_engine.abort(new_id("never-seen"))
        rid = new_id("done")
        prompt = chat_ids(model, LONG)
        async with asyncio.timeout(SAFETY_S):
            done = [s async for s in contract_engine.generate(rid, prompt, GREEDY)]
        await contract_engine.abort(rid)
        assert done[-1].finish_reason == "length"
        steps = await collect(contract_engine, prompt, GREEDY, "after")
        assert ids_of(steps) == ids_of(done) and steps[-1].finish_reason == "length"

    async def test_closing_the_generator_frees_the_engine(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        prompt = chat_ids(model, LONG)
        reference = await collect(contract_engine, prompt, GREEDY, "reference")
        walked: AsyncIterator[StepOutput] = contract_engine.generate(
            new_id("walk-away"), prompt, SamplingParams(max_tokens=1000, temperature=0.0)
        )
        async with asyncio.timeout(SAFETY_S):
            await anext(walked)
            await anext(walked)
            await walked.aclose()  # type: ignore[attr-defined]
        await self._assert_released(contract_engine)
        # a serial engine still decoding the 1000 tokens would hold this one back
        steps = await collect(contract_engine, prompt, GREEDY, "next")
        assert ids_of(steps) == ids_of(reference)

    # -- concurrency -----------------------------------------------------------------

    async def test_concurrent_requests_complete_with_their_own_outputs(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        prompts = [chat_ids(model, LONG), chat_ids(model, OTHER)]
        alone = [await collect(contract_engine, p, GREEDY, "alone") for p in prompts]
        assert ids_of(alone[0]) != ids_of(alone[1])
        together = await asyncio.gather(
            *(collect(contract_engine, p, GREEDY, "together") for p in prompts)
        )
        for mine, reference in zip(together, alone, strict=True):
            assert_well_formed(mine)
            assert ids_of(mine) == ids_of(reference)
            assert mine[-1].finish_reason == reference[-1].finish_reason

    # -- errors ----------------------------------------------------------------------

    @pytest.mark.parametrize("bad", ["out_of_vocabulary", "empty"])
    async def test_bad_prompt_raises_engine_error_then_serves_the_next(
        self, contract_engine: Engine, model: ModelInfo, bad: str
    ) -> None:
        prompt = {"out_of_vocabulary": [10**7], "empty": []}[bad]
        with pytest.raises(EngineError):
            await collect(contract_engine, prompt, SamplingParams(max_tokens=2), bad)
        await self._assert_released(contract_engine)
        steps = await collect(contract_engine, chat_ids(model, LONG), GREEDY, "good")
        assert len(ids_of(steps)) == GREEDY.max_tokens

    async def test_images_for_a_model_that_does_not_see_raise_engine_error(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        """(The API refuses them first: its worker declared ``images`` False.)"""
        if contract_engine.images:
            pytest.skip("its model sees")
        gen = contract_engine.generate(
            f"images-{uuid.uuid4().hex}", chat_ids(model, SHORT), GREEDY, images=[PNG_1X1]
        )
        with pytest.raises(EngineError):
            async with asyncio.timeout(SAFETY_S):
                async for _ in gen:
                    pass
        await self._assert_released(contract_engine)

    async def test_generate_before_start_raises_engine_error(
        self, contract_cold_engine: Engine, model: ModelInfo
    ) -> None:
        with pytest.raises(EngineError):
            await collect(contract_cold_engine, chat_ids(model, SHORT), GREEDY, "cold")

    # -- sampling fields -------------------------------------------------------------

    @staticmethod
    async def _greedy_answer(engine: Engine, model: ModelInfo) -> tuple[list[int], list[int]]:
        """The prompt of a short question and its greedy answer, EOS included."""
        prompt = chat_ids(model, SHORT)
        params = SamplingParams(max_tokens=EOS_WITHIN, temperature=0.0)
        full = ids_of(await collect(engine, prompt, params, "answer"))
        assert len(full) > 3 and full[-1] in model.eos_token_ids
        assert not set(full[:-1]) & set(model.eos_token_ids)
        return prompt, full

    async def test_logprobs_are_absent_unless_asked(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        steps = await collect(contract_engine, chat_ids(model, SHORT), GREEDY, "no-logprobs")
        assert steps and all(step.logprobs is None for step in steps)

    @pytest.mark.parametrize(("temperature", "k"), [(0.0, 0), (0.0, 3), (1.0, 2)])
    async def test_logprobs_one_per_id_with_k_alternatives_best_first(
        self, contract_engine: Engine, model: ModelInfo, temperature: float, k: int
    ) -> None:
        prompt = chat_ids(model, LONG)
        plain = SamplingParams(max_tokens=8, temperature=temperature, seed=7)
        asked = SamplingParams(max_tokens=8, temperature=temperature, seed=7, logprobs=k)
        reference = await collect(contract_engine, prompt, plain, "plain")
        steps = await collect(contract_engine, prompt, asked, "logprobs")
        assert_well_formed(steps)
        assert ids_of(steps) == ids_of(reference)  # asking for logprobs changes no id
        for step in steps:
            assert step.logprobs is not None and len(step.logprobs) == len(step.token_ids)
            for token_id, sampled in zip(step.token_ids, step.logprobs, strict=True):
                assert math.isfinite(sampled.logprob) and sampled.logprob <= 0
                assert len(sampled.top) == k
                assert len({t for t, _ in sampled.top}) == k  # k different ids
                values = [lp for _, lp in sampled.top]
                assert values == sorted(values, reverse=True)  # best first
                assert all(math.isfinite(lp) and lp <= 0 for lp in values)
                for alternative, logprob in sampled.top:
                    if alternative == token_id:
                        assert logprob == pytest.approx(sampled.logprob, abs=1e-4)
                if k and temperature == 0:
                    assert sampled.top[0][0] == token_id  # greedy: the best id is the one

    async def test_stop_token_ids_end_with_stop_on_that_id(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        prompt, full = await self._greedy_answer(contract_engine, model)
        stop_id = full[2]
        cut = full.index(stop_id) + 1
        for ignore_eos in (False, True):  # ignore_eos ignores the EOS, not the stop ids
            params = SamplingParams(
                max_tokens=EOS_WITHIN,
                temperature=0.0,
                stop_token_ids=(stop_id,),
                ignore_eos=ignore_eos,
            )
            steps = await collect(contract_engine, prompt, params, "stop-id")
            assert_well_formed(steps)
            assert ids_of(steps) == full[:cut] and steps[-1].finish_reason == "stop"

    async def test_ignore_eos_runs_to_max_tokens_past_the_eos(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        prompt, full = await self._greedy_answer(contract_engine, model)
        params = SamplingParams(max_tokens=len(full) + 6, temperature=0.0, ignore_eos=True)
        steps = await collect(contract_engine, prompt, params, "ignore-eos")
        assert_well_formed(steps)
        ids = ids_of(steps)
        assert ids[: len(full)] == full  # the EOS came, and did not end it
        assert len(ids) == len(full) + 6 and steps[-1].finish_reason == "length"

    @pytest.mark.parametrize("masked", ["eos", "stop_id"])
    async def test_min_tokens_masks_the_eos_and_stop_ids_before_that_many(
        self, contract_engine: Engine, model: ModelInfo, masked: str
    ) -> None:
        prompt, full = await self._greedy_answer(contract_engine, model)
        if masked == "eos":
            ends, at, stop_ids = set(model.eos_token_ids), len(full) - 1, ()
        else:
            ends, at, stop_ids = {full[2]}, full.index(full[2]), (full[2],)
        least = at + 4  # the answer would have ended at ``at``
        params = SamplingParams(
            max_tokens=least + 16, temperature=0.0, min_tokens=least, stop_token_ids=stop_ids
        )
        steps = await collect(contract_engine, prompt, params, "min-tokens")
        assert_well_formed(steps)
        ids = ids_of(steps)
        assert ids[:at] == full[:at]  # the same answer up to the masked id
        assert len(ids) >= least and not set(ids[:least]) & ends
        assert not set(ids[:least]) & set(model.eos_token_ids)
        if steps[-1].finish_reason == "stop":
            assert ids[-1] in ends | set(model.eos_token_ids)

    @pytest.mark.parametrize("bias", [100.0, -100.0])
    async def test_logit_bias_decides_a_greedy_answer(
        self, contract_engine: Engine, model: ModelInfo, bias: float
    ) -> None:
        prompt = chat_ids(model, SHORT)
        plain = ids_of(await collect(contract_engine, prompt, GREEDY, "plain"))
        target = model.encode(" lighthouse")[0] if bias > 0 else plain[0]
        assert bias < 0 or target not in plain
        params = SamplingParams(max_tokens=4, temperature=0.0, logit_bias={target: bias})
        steps = await collect(contract_engine, prompt, params, "bias")
        assert_well_formed(steps)
        ids = ids_of(steps)
        assert (ids[0] == target) if bias > 0 else (target not in ids)

    @pytest.mark.parametrize("narrowed", ["top_k", "min_p"])
    async def test_sampling_narrowed_to_the_best_id_is_greedy(
        self, contract_engine: Engine, model: ModelInfo, narrowed: str
    ) -> None:
        prompt = chat_ids(model, LONG)
        greedy = ids_of(await collect(contract_engine, prompt, GREEDY, "greedy"))
        narrow: dict[str, Any] = {"top_k": {"top_k": 1}, "min_p": {"min_p": 1.0}}[narrowed]
        params = SamplingParams(max_tokens=GREEDY.max_tokens, temperature=1.0, **narrow)
        assert ids_of(await collect(contract_engine, prompt, params, narrowed)) == greedy

    @pytest.mark.parametrize("penalty", list(PENALTIES))
    async def test_a_penalty_changes_a_greedy_answer(
        self, contract_engine: Engine, model: ModelInfo, penalty: str
    ) -> None:
        prompt = chat_ids(model, LONG)
        plain = SamplingParams(max_tokens=24, temperature=0.0)
        penalized = SamplingParams(max_tokens=24, temperature=0.0, **PENALTIES[penalty])
        reference = ids_of(await collect(contract_engine, prompt, plain, "plain"))
        assert ids_of(await collect(contract_engine, prompt, penalized, penalty)) != reference

    @pytest.mark.parametrize("kind", list(STRUCTURED))
    async def test_structured_output_is_valid_json(
        self, contract_engine: Engine, model: ModelInfo, kind: str
    ) -> None:
        params = SamplingParams(
            max_tokens=JSON_MAX_TOKENS, temperature=0.0, structured=STRUCTURED[kind]
        )
        steps = await collect(contract_engine, chat_ids(model, JSON_QUESTION), params, kind)
        assert_well_formed(steps)
        ids = ids_of(steps)
        assert steps[-1].finish_reason == "stop" and ids[-1] in model.eos_token_ids
        value = json.loads(model.decode(ids[:-1]))
        assert isinstance(value, dict)
        if kind == "json_schema":
            assert isinstance(value.get("city"), str)

    @pytest.mark.parametrize("under", ["structured", "penalties"])
    async def test_a_continuation_under_structured_output_or_penalties_is_the_rest(
        self, contract_engine: Engine, model: ModelInfo, under: str
    ) -> None:
        """The ids handed over count as made by the engine: the grammar has seen them, and
        the penalties count them (an engine that starts afresh after them diverges)."""
        if under == "structured":
            prompt = chat_ids(model, JSON_QUESTION)
            params = SamplingParams(
                max_tokens=JSON_MAX_TOKENS, temperature=0.0, structured=STRUCTURED["json_schema"]
            )
            cut = 3  # inside the object
        else:
            prompt = chat_ids(model, LONG)
            params = SamplingParams(
                max_tokens=32,
                temperature=0.0,
                presence_penalty=2.0,
                frequency_penalty=1.0,
                repetition_penalty=1.2,
            )
            cut = 12
        whole = await collect(contract_engine, prompt, params, "whole")
        rest = await collect(contract_engine, prompt, params, "rest", ids_of(whole)[:cut])
        assert_well_formed(rest)
        assert ids_of(rest) == ids_of(whole)[cut:]
        assert rest[-1].finish_reason == whole[-1].finish_reason

    async def test_an_out_of_vocabulary_logit_bias_raises_engine_error(
        self, contract_engine: Engine, model: ModelInfo
    ) -> None:
        params = SamplingParams(max_tokens=2, logit_bias={10**7: 1.0})
        with pytest.raises(EngineError):
            await collect(contract_engine, chat_ids(model, SHORT), params, "bad-bias")
        await self._assert_released(contract_engine)
