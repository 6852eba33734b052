"""Images through the API to a real vLLM worker whose model sees: a tiny Idefics3-shaped
model with random weights, made here (tests/vllm/vision_model.py; no model hub). Its
answers are noise; what is asserted is the plumbing: the worker declares that its model
sees, the image travels in the job to vLLM as multi-modal data (vLLM's processor widens
the prompt's one ``<image>`` into the image's tokens, so the usage's prompt count is the
text's plus those), the answer streams and ends -- for chat and for Responses. The
embedded SmolLM2 beside it does not see: its 400 is tests/e2e/test_images.py."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.tokenize import ModelInfo
from tests.e2e.conftest import Stack
from tests.e2e.helpers import read_all
from tests.vllm import vision_model
from tests.vllm.conftest import vllm_stack

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore"), pytest.mark.timeout(600)]

MODEL = "tiny-vision"
QUESTION = "What colour is this?"


@pytest.fixture(scope="module")
def vision_dir(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Path:
    return vision_model.build(model_dir, tmp_path_factory.mktemp("vision") / MODEL)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, vision_dir: Path
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("vllm-vision")
    with vllm_stack(tmp, redis_url, database_url, vision_dir, model_name=MODEL) as st:
        yield st


def png(colour: tuple[int, int, int], size: tuple[int, int] = (40, 30)) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def text_prompt_tokens(vision_dir: Path) -> int:
    """The prompt's tokens as the API counts them: one ``<image>`` for the image."""
    info = ModelInfo.load(vision_dir)
    parts = [{"type": "text", "text": QUESTION}, {"type": "image"}]
    ids = info.encode(info.render_chat([{"role": "user", "content": parts}]))
    assert ids.count(info.tokenizer.token_to_id(vision_model.IMAGE)) == 1
    return len(ids)


def chunks(stack: Stack, route: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.Client(base_url=stack.url, timeout=300) as client:
        _, events = read_all(client, "POST", route, json=body)
    return [json.loads(e.data) for e in events if e.data and e.data != "[DONE]"]


def test_the_worker_declares_that_its_model_sees(stack: Stack) -> None:
    store = stack.store()
    raw = store.hget(f"{stack.settings.key_prefix}:models", MODEL)
    assert raw is not None, "the worker declared no model"
    assert json.loads(raw)["images"] is True


def test_a_chat_image_reaches_vllm_and_the_answer_streams_to_its_end(
    stack: Stack, vision_dir: Path
) -> None:
    content = [
        {"type": "text", "text": QUESTION},
        {"type": "image_url", "image_url": {"url": png((200, 20, 20)), "detail": "low"}},
    ]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    got = chunks(stack, "/v1/chat/completions", body)
    finishes = [c["choices"][0]["finish_reason"] for c in got if c["choices"]]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    usage = got[-1]["usage"]
    assert usage["completion_tokens"] == 6
    # vLLM widened the one <image> into the image's tokens: it had the pixels
    expected = text_prompt_tokens(vision_dir) - 1 + vision_model.IMAGE_TOKENS
    assert usage["prompt_tokens"] == expected, usage


def test_a_responses_input_image_reaches_vllm_too(stack: Stack, vision_dir: Path) -> None:
    content = [
        {"type": "input_text", "text": QUESTION},
        {"type": "input_image", "image_url": png((20, 20, 200), (64, 64)), "detail": "auto"},
    ]
    body = {
        "model": MODEL,
        "input": [{"role": "user", "content": content}],
        "max_output_tokens": 5,
        "temperature": 0,
        "stream": True,
    }
    got = chunks(stack, "/v1/responses", body)
    # (random weights write no end: the answer ends at its budget)
    assert got[-1]["type"] == "response.incomplete", got[-1]
    assert got[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    usage = got[-1]["response"]["usage"]
    expected = text_prompt_tokens(vision_dir) - 1 + vision_model.IMAGE_TOKENS
    assert usage["input_tokens"] == expected, usage


def test_two_images_are_two_placeholders_widened(stack: Stack, vision_dir: Path) -> None:
    image = {"type": "image_url", "image_url": {"url": png((0, 255, 0))}}
    content = [{"type": "text", "text": QUESTION}, image, image]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 3}
    resp = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text
    expected = text_prompt_tokens(vision_dir) + 2 * (vision_model.IMAGE_TOKENS - 1) + 1
    assert resp.json()["usage"]["prompt_tokens"] == expected


def test_an_image_that_is_no_image_is_a_400_before_the_engine(stack: Stack) -> None:
    content = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,aGVsbG8="}}]
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
    resp = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "messages[0].content[0]"
    remote = [{"type": "image_url", "image_url": {"url": "https://example.com/a.png"}}]
    body["messages"] = [{"role": "user", "content": remote}]
    resp = httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "image_url_not_allowed"
