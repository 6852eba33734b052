"""Images sent to a model that does not see (the embedded SmolLM2-135M-Instruct, whose
worker declares no images): the schemas take OpenAI's image parts, and the request is a
400 in OpenAI's error shape naming the model and the part -- never an image dropped
in silence. (A model that sees: tests/vllm/test_vllm_images.py.)"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from openai import BadRequestError, OpenAI

from tests.e2e.conftest import Stack

# a 1x1 PNG
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode()


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def image_chat(model: str, url: str = DATA_URL, **extra: Any) -> dict[str, Any]:
    content = [
        {"type": "text", "text": "What is in this image?"},
        {"type": "image_url", "image_url": {"url": url, "detail": "low"}},
    ]
    return {"model": model, "messages": [{"role": "user", "content": content}], **extra}


def assert_not_seen(resp: httpx.Response, model: str, param: str) -> None:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error == {
        "message": error["message"],
        "type": "invalid_request_error",
        "param": param,
        "code": "image_input_not_supported",
    }
    assert f"the model '{model}' does not accept images" in error["message"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(
    "url", [DATA_URL, "https://example.com/cat.png"], ids=["data-url", "remote-url"]
)
def test_an_image_for_a_model_that_does_not_see_is_a_400_naming_it(
    stack: Stack, client: httpx.Client, stream: bool, url: str
) -> None:
    resp = client.post("/v1/chat/completions", json=image_chat(stack.model, url, stream=stream))
    assert_not_seen(resp, stack.model, "messages[0].content[1]")


def test_responses_input_image_is_the_same_400(stack: Stack, client: httpx.Client) -> None:
    content = [
        {"type": "input_text", "text": "What is in this image?"},
        {"type": "input_image", "image_url": DATA_URL, "detail": "auto"},
    ]
    body = {"model": stack.model, "input": [{"role": "user", "content": content}]}
    assert_not_seen(client.post("/v1/responses", json=body), stack.model, "input[0].content[1]")


def test_the_sdk_sees_the_400(stack: Stack, sdk: OpenAI) -> None:
    with pytest.raises(BadRequestError) as err:
        sdk.chat.completions.create(**image_chat(stack.model))
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "image_input_not_supported", body
    assert body["param"] == "messages[0].content[1]"


@pytest.mark.parametrize(
    ("part", "param"),
    [
        ({"type": "image_url", "image_url": {"url": DATA_URL, "detail": "huge"}}, "detail"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "type"),
    ],
)
def test_a_part_the_schema_does_not_take_is_a_400_naming_it(
    stack: Stack, client: httpx.Client, part: dict[str, Any], param: str
) -> None:
    body = {"model": stack.model, "messages": [{"role": "user", "content": [part]}]}
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert param in (resp.json()["error"]["param"] or ""), resp.text


def test_text_parts_alone_are_answered_as_before(stack: Stack, client: httpx.Client) -> None:
    content = [{"type": "text", "text": "say "}, {"type": "text", "text": "hi"}]
    body = {"model": stack.model, "messages": [{"role": "user", "content": content}]}
    resp = client.post("/v1/chat/completions", json={**body, "max_tokens": 4})
    assert resp.status_code == 200, resp.text


def test_tokenize_refuses_images_for_a_model_that_does_not_see(
    stack: Stack, client: httpx.Client
) -> None:
    body = {k: v for k, v in image_chat(stack.model).items() if k in ("model", "messages")}
    assert_not_seen(client.post("/tokenize", json=body), stack.model, "messages[0].content[1]")
