"""The official openai SDK, unmodified, against the server."""

from __future__ import annotations

import openai
import pytest
from openai import OpenAI

from tests.e2e.conftest import Stack
from tests.e2e.helpers import LONG, ledger_row


@pytest.fixture
def sdk(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_chat_streaming_with_usage(stack: Stack, sdk: OpenAI) -> None:
    stream = sdk.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": LONG}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == LONG
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert finals == ["stop"]
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens > 0
    row = ledger_row(stack.settings.database_url or "", chunks[0].id)
    assert row is not None and row["completion_tokens"] == usage.completion_tokens
    assert row["prompt_tokens"] == usage.prompt_tokens


def test_chat_non_streaming(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Hello, €uro 🤖"}]
    )
    assert resp.object == "chat.completion"
    assert resp.choices[0].message.content == "Hello, €uro 🤖"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_text_completions(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.completions.create(model=stack.model, prompt="one two three", max_tokens=2)
    assert resp.choices[0].finish_reason == "length"
    assert "one two three".startswith(resp.choices[0].text)
    chunks = list(sdk.completions.create(model=stack.model, prompt="one two three", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == "one two three"


def test_models(stack: Stack, sdk: OpenAI) -> None:
    assert [m.id for m in sdk.models.list()] == [stack.model]


def test_errors_map_to_sdk_exceptions(stack: Stack, sdk: OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:  # OpenAI's and vLLM's 404
        sdk.chat.completions.create(model="gpt-nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"  # type: ignore[index]
    assert info.value.body["param"] == "model"  # type: ignore[index]
