"""Through the API with a real vLLM worker process: stream, resume, stop strings, lengths."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import jsonschema
import pytest
from httpx_sse import EventSource
from openai import OpenAI

from bench.vllm_bench_serve import vllm_bench
from service.stream.ids import Cursor, EventId
from tests.e2e.conftest import Stack
from tests.e2e.helpers import (
    assert_ids_increase,
    content_of,
    finish_reason,
    read_all,
    tool_calls_of,
)
from tests.vllm.conftest import vllm_stack

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore")]

QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with vllm_stack(tmp_path_factory.mktemp("vllm"), redis_url, database_url, model_dir) as st:
        yield st


@pytest.fixture
def sdk(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)


def chat(stack: Stack, content: str, **extra: object) -> dict[str, object]:
    return {
        "model": stack.model,
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        **extra,
    }


def test_stream_drop_and_resume(stack: Stack) -> None:
    body = chat(stack, "Write three sentences about the sea.", stream=True, max_tokens=60)
    seen = []
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            rid = r.headers["x-request-id"]
            for event in EventSource(r).iter_sse():
                seen.append(event)
                if len(seen) == 10:
                    break
        _, rest = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": seen[-1].id}
        )
        _, whole = read_all(client, "GET", f"/v1/requests/{rid}/events")
    joined = seen + rest
    assert_ids_increase(joined)
    assert content_of(joined) == content_of(whole) and len(content_of(whole)) > 40
    assert finish_reason(joined) in ("stop", "length")


def test_stop_string_ends_early_and_max_tokens(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=120) as client:
        full = client.post("/v1/chat/completions", json=chat(stack, QUESTION, max_tokens=30)).json()
        text = full["choices"][0]["message"]["content"]
        assert "Paris" in text
        cut = client.post(
            "/v1/chat/completions", json=chat(stack, QUESTION, max_tokens=30, stop=["Paris"])
        ).json()
        assert cut["choices"][0]["message"]["content"] == text[: text.index("Paris")]
        assert cut["choices"][0]["finish_reason"] == "stop"
        assert cut["usage"]["completion_tokens"] < full["usage"]["completion_tokens"]
        short = client.post("/v1/chat/completions", json=chat(stack, QUESTION, max_tokens=3)).json()
        assert short["choices"][0]["finish_reason"] == "length"
        assert short["usage"]["completion_tokens"] == 3


def test_two_concurrent_streams_interleave(stack: Stack) -> None:
    """Both are generated in the same engine steps, not one after the other: judged by
    the order of their event ids (Redis stamps both logs from one clock), not by time."""
    import threading

    written: dict[str, list[EventId]] = {"a": [], "b": []}

    def run(label: str) -> None:
        # a raw text completion that keeps counting: no early EOS
        body = {
            "model": stack.model,
            "prompt": f"List {label}: 1, 2, 3, 4, 5, 6, 7,",
            "max_tokens": 40,
            "temperature": 0,
            "stream": True,
        }
        with (
            httpx.Client(base_url=stack.url, timeout=120) as client,
            client.stream("POST", "/v1/completions", json=body) as r,
        ):
            for event in EventSource(r).iter_sse():
                if event.data != "[DONE]" and json.loads(event.data)["choices"]:
                    written[label].append(Cursor.parse(event.id).event)

    threads = [threading.Thread(target=run, args=(x,)) for x in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    a, b = written["a"], written["b"]
    assert len(a) > 10 and len(b) > 10
    assert a[0] < b[-1] and b[0] < a[-1]  # neither ended before the other began
    # most of one's events were written while the other one was being written too
    inside_a = [e for e in b if a[0].ms <= e.ms <= a[-1].ms]
    inside_b = [e for e in a if b[0].ms <= e.ms <= b[-1].ms]
    assert len(inside_a) > len(b) // 2 or len(inside_b) > len(a) // 2, (a, b)


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
    "required": ["city", "country"],
    "additionalProperties": False,
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def test_json_schema_output_validates(stack: Stack, sdk: OpenAI) -> None:
    """vLLM's structured outputs, through the API: the answer is JSON of the schema."""
    resp = sdk.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "Name a city and its country."}],
        temperature=0,
        max_tokens=60,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "place", "schema": CITY_SCHEMA},
        },
    )
    assert resp.choices[0].finish_reason == "stop", resp
    jsonschema.validate(json.loads(resp.choices[0].message.content or ""), CITY_SCHEMA)


def test_named_tool_choice_arguments_validate(stack: Stack, sdk: OpenAI) -> None:
    """A named tool_choice constrains the output to the function's parameters; the
    stream's tool_calls pieces join to arguments that validate."""
    stream = sdk.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        temperature=0,
        max_tokens=60,
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        stream=True,
    )
    content, calls, finishes = tool_calls_of(list(stream))
    assert list(calls) == [0]
    name, args = calls[0]["name"], calls[0]["arguments"]
    assert content == ""
    assert name == "get_weather"
    assert finishes == ["tool_calls"]
    jsonschema.validate(json.loads(args), WEATHER_TOOL["function"]["parameters"])  # type: ignore[index]


def test_logprobs_from_vllm(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=3,
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.content
    for item in lp.content:
        assert len(item.top_logprobs) == 3
        assert item.logprob <= 0.0
        # greedy: the sampled token is the most likely one
        assert item.top_logprobs[0].token == item.token
    text = b"".join(bytes(t.bytes or []) for t in lp.content).decode("utf-8", "replace")
    assert text == resp.choices[0].message.content


@pytest.mark.parametrize("backend", ["openai-chat", "openai"])
def test_vllm_bench_serve_completes_every_request(
    stack: Stack, model_dir: Path, tmp_path: Path, backend: str
) -> None:
    """vLLM's own benchmark, unmodified, through its module: every request completes with
    OpenAI's literal framing asked for (``--header X-SSE-Framing=openai``); without it, its
    literal parser fails on the ``retry:`` and ``id:`` lines the resumable framing sends."""

    def run(framed: bool) -> dict[str, float]:
        return vllm_bench(
            stack.url, backend, model_dir, num_prompts=8, input_len=32, output_len=16,
            framed=framed, out=tmp_path,
        )  # fmt: skip

    framed = run(True)
    assert (framed["completed"], framed["num_prompts"]) == (8, 8), framed
    assert framed["total_output_tokens"] > 0
    plain = run(False)
    assert plain["completed"] == 0, plain
