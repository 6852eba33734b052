"""A LoRA adapter on the vLLM worker, chosen by the request's ``model`` as with ``vllm serve
--lora-modules``: the adapter's answer is the one peft + transformers give for the same
adapter, the base model's is unchanged beside it, and ``/v1/models`` lists the adapter
with its base as ``parent``.

The adapter is made here with peft on SmolLM2 (rank 8 on q_proj and v_proj, random
weights from a fixed seed, scaled so that greedy decoding answers otherwise).

vLLM 0.32's CPU build gets a batch that mixes the adapter and the base model wrong: the
base rows are given the adapter's output too (vLLM alone does it: ``LLM.chat`` of four
prompts with ``lora_request=[None, lora, None, lora]``; docs/operations/known-limits.md). So the
requests here run one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Stack, make_stack
from tests.vllm.conftest import VLLM_SETTINGS

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(600)]

ADAPTER = "tone"
QUESTION = "What is the capital of France?"
MAX_TOKENS = 16


Reference = Callable[[list[int]], tuple[str, str]]


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> tuple[Path, Reference]:
    """The adapter's directory, and the greedy answers to a prompt's token ids with and
    without it (transformers + peft)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path_factory.mktemp("lora") / ADAPTER
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = LoraConfig(
        r=8, lora_alpha=24, target_modules=["q_proj", "v_proj"], init_lora_weights=False
    )
    model = get_peft_model(base, config)
    model.save_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def greedy(prompt: list[int]) -> str:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            made = model.generate(ids, max_new_tokens=MAX_TOKENS, do_sample=False)
        return str(tokenizer.decode(made[0, ids.shape[1] :], skip_special_tokens=True))

    def reference(prompt: list[int]) -> tuple[str, str]:
        with_adapter = greedy(prompt)
        with model.disable_adapter():
            without = greedy(prompt)
        assert with_adapter != without, "the adapter changes nothing: no test"
        return with_adapter, without

    return out, reference


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    database_url: str,
    model_dir: Path,
    adapter: tuple[Path, Reference],
) -> Iterator[Stack]:
    st = make_stack(tmp_path_factory.mktemp("vllm-lora"), redis_url, database_url, model_dir)
    try:
        st.start_worker(lora_modules=f"{ADAPTER}={adapter[0]}", **VLLM_SETTINGS)
        st.start_api()
        yield st
    finally:
        st.stop()


def answer(st: Stack, model: str) -> str:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    r = httpx.post(f"{st.url}/v1/chat/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == model
    return str(r.json()["choices"][0]["message"]["content"])


def references(stack: Stack, adapter: tuple[Path, Reference]) -> dict[str, str]:
    """What transformers + peft answer, with and without the adapter, to the prompt as the
    chat route renders it (lastevent's chat template; vLLM's /tokenize route)."""
    messages = [{"role": "user", "content": QUESTION}]
    tokenized = httpx.post(f"{stack.url}/tokenize", json={"messages": messages}, timeout=60)
    with_adapter, without = adapter[1](tokenized.json()["tokens"])
    return {ADAPTER: with_adapter, stack.model: without}


def test_the_adapter_answers_as_peft_does_and_the_base_as_itself(
    stack: Stack, adapter: tuple[Path, Reference]
) -> None:
    wanted = references(stack, adapter)
    for model in [ADAPTER, stack.model, ADAPTER, stack.model]:  # one at a time
        assert answer(stack, model) == wanted[model], model


def test_models_lists_the_adapter_with_its_parent(stack: Stack) -> None:
    data = httpx.get(f"{stack.url}/v1/models", timeout=30).json()["data"]
    found = {m["id"]: m for m in data}
    assert set(found) == {stack.model, ADAPTER}
    assert found[ADAPTER]["parent"] == stack.model and found[stack.model]["parent"] is None
