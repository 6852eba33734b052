"""The chat-completions contract beyond text, through the unmodified openai SDK: tool
calls (streamed, assembled by the SDK's helper, resumed in the middle of an argument
string), structured output, logprobs, n > 1, the sampling fields vLLM users send,
``user`` in the ledger, and a 400 naming every field that cannot be honoured.

The scripted engine echoes the last user message through the real tokenizer, so a
test scripts the model's output -- tool-call markers and all -- by sending it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pydantic
import pytest
from openai import BadRequestError, OpenAI

from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import chat_body, ledger_row, raw_events, read_all, tool_calls_of

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city"],
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
ARGS_1 = {"city": "Zürich", "unit": "°C"}
ARGS_2 = {"zone": "東京 🗼"}


def hermes(name: str, args: dict[str, Any]) -> str:
    call = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{call}\n</tool_call>"


TWO_CALLS = "Let me check. " + hermes("get_weather", ARGS_1) + "\n" + hermes("get_time", ARGS_2)


@pytest.fixture
def sdk(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture
def client(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        yield c


def test_streamed_tool_calls_are_pieces_of_two_calls_and_the_marker_never_leaks(
    stack: Stack, sdk: OpenAI
) -> None:
    stream = sdk.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": TWO_CALLS}],
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        stream=True,
    )
    chunks = list(stream)
    content, calls, finishes = tool_calls_of(chunks)
    assert content == "Let me check."  # the space before a call is not content
    assert "<tool" not in content
    assert [calls[0]["name"], calls[1]["name"]] == ["get_weather", "get_time"]
    assert json.loads(calls[0]["arguments"]) == ARGS_1
    assert json.loads(calls[1]["arguments"]) == ARGS_2
    assert calls[0]["id"].startswith("call_") and calls[0]["id"] != calls[1]["id"]
    assert finishes == ["tool_calls"]
    pieces = sum(1 for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    assert pieces > 2, "arguments arrive as fragments, not one chunk per call"


def test_non_streaming_tool_calls_and_parallel_false(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": TWO_CALLS}],
        tools=[WEATHER, TIME],  # type: ignore[list-item]
    )
    msg = resp.choices[0].message
    assert resp.choices[0].finish_reason == "tool_calls"
    assert msg.content == "Let me check."
    assert msg.tool_calls is not None
    assert [c.function.name for c in msg.tool_calls] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    assert json.loads(msg.tool_calls[1].function.arguments) == ARGS_2  # type: ignore[union-attr]
    one = sdk.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": TWO_CALLS}],
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        parallel_tool_calls=False,
    )
    assert one.choices[0].message.tool_calls is not None
    assert len(one.choices[0].message.tool_calls) == 1
    assert one.choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_shows_the_text_as_it_is(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": TWO_CALLS}],
        tools=[WEATHER, TIME],  # type: ignore[list-item]
        tool_choice="none",
    )
    assert resp.choices[0].message.content == TWO_CALLS
    assert resp.choices[0].message.tool_calls is None
    assert resp.choices[0].finish_reason == "stop"


def test_the_sdk_stream_helper_assembles_the_calls(stack: Stack, sdk: OpenAI) -> None:
    with sdk.chat.completions.stream(
        model=stack.model,
        messages=[{"role": "user", "content": hermes("get_weather", ARGS_1)}],
        tools=[WEATHER],  # type: ignore[list-item]
    ) as stream:
        done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
        final = stream.get_final_completion()
    assert [json.loads(e.arguments) for e in done] == [ARGS_1]
    calls = final.choices[0].message.tool_calls
    assert calls is not None and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert final.choices[0].finish_reason == "tool_calls"


def test_a_stream_cut_inside_an_argument_string_resumes_exactly(
    stack: Stack, client: httpx.Client
) -> None:
    body = chat_body(stack.model, TWO_CALLS, stream=True, tools=[WEATHER, TIME])
    rid, live = raw_events(client, "POST", "/v1/chat/completions", json=body)
    _, events = read_all(client, "GET", f"/v1/requests/{rid}/events")
    # a piece of the first call's arguments that ends inside the "Zürich" string
    cut = next(
        i
        for i, e in enumerate(events)
        if e.data.startswith("{")
        and (tc := json.loads(e.data)["choices"][0]["delta"].get("tool_calls"))
        and "Z" in tc[0]["function"].get("arguments", "")
    )
    _, rest = read_all(
        client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": events[cut].id}
    )
    assert [(e.id, e.data) for e in rest] == [(e.id, e.data) for e in events[cut + 1 :]]
    _, replay = raw_events(client, "GET", f"/v1/requests/{rid}/events")
    assert replay == live  # tool-call pieces are log events: the bytes replay


def test_a_conversation_with_earlier_calls_and_tool_answers(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.chat.completions.create(
        model=stack.model,
        messages=[
            {"role": "user", "content": "Weather in Zürich?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": json.dumps(ARGS_1)},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "12 °C, rain"},
        ],
        tools=[WEATHER],  # type: ignore[list-item]
    )
    # SmolLM2's template knows no tools: the tool's answer is a Hermes-style user turn,
    # which the scripted engine echoes
    assert resp.choices[0].message.content == "<tool_response>\n12 °C, rain\n</tool_response>"


class City(pydantic.BaseModel):
    city: str
    population: int


def test_structured_output_parses_into_the_model(stack: Stack, sdk: OpenAI) -> None:
    text = json.dumps({"city": "Zürich", "population": 423000}, ensure_ascii=False)
    parsed = sdk.chat.completions.parse(
        model=stack.model, messages=[{"role": "user", "content": text}], response_format=City
    )
    assert parsed.choices[0].message.parsed == City(city="Zürich", population=423000)


def test_logprobs_travel_with_their_tokens_and_replay(stack: Stack, sdk: OpenAI) -> None:
    text = "Café 日本 🤖"
    resp = sdk.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": text}],
        logprobs=True,
        top_logprobs=2,
    )
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.content is not None
    assert resp.usage is not None
    # one per completion token but the EOS; their bytes are the text's
    assert len(lp.content) == resp.usage.completion_tokens - 1
    assert b"".join(bytes(t.bytes or []) for t in lp.content).decode() == text
    assert all(len(t.top_logprobs) == 2 for t in lp.content)
    chunks = list(
        sdk.chat.completions.create(
            model=stack.model,
            messages=[{"role": "user", "content": text}],
            logprobs=True,
            stream=True,
        )
    )
    streamed = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content or []
    ]
    assert [t.token for t in streamed] == [t.token for t in lp.content]
    plain = sdk.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": text}]
    )
    assert plain.choices[0].logprobs is None


def test_completions_logprobs(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.completions.create(model=stack.model, prompt="one two three", logprobs=1)
    lp = resp.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.text_offset is not None
    assert "".join(lp.tokens) == resp.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)


def test_n_choices_share_one_log(stack: Stack, sdk: OpenAI, client: httpx.Client) -> None:
    resp = sdk.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Zwei 二"}], n=3
    )
    assert [c.index for c in resp.choices] == [0, 1, 2]
    assert all(c.message.content == "Zwei 二" for c in resp.choices)
    assert all(c.finish_reason == "stop" for c in resp.choices)
    one = sdk.chat.completions.create(
        model=stack.model, messages=[{"role": "user", "content": "Zwei 二"}]
    )
    assert resp.usage is not None and one.usage is not None
    assert resp.usage.completion_tokens == 3 * one.usage.completion_tokens
    assert resp.usage.prompt_tokens == one.usage.prompt_tokens
    body = chat_body(stack.model, "Zwei 二", stream=True, n=2)
    rid, live = raw_events(client, "POST", "/v1/chat/completions", json=body)
    _, events = read_all(client, "GET", f"/v1/requests/{rid}/events")
    texts = {0: "", 1: ""}
    finishes = {}
    for e in events:
        if not e.data.startswith("{"):
            continue
        for choice in json.loads(e.data)["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
            if choice["finish_reason"]:
                finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: "Zwei 二", 1: "Zwei 二"}
    assert finishes == {0: "stop", 1: "stop"}
    mid = len(events) // 2
    _, rest = read_all(
        client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": events[mid].id}
    )
    assert [e.data for e in rest] == [e.data for e in events[mid + 1 :]]
    assert raw_events(client, "GET", f"/v1/requests/{rid}/events")[1] == live


def test_the_sampling_fields_vllm_users_send_are_taken(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.chat.completions.create(
        model=stack.model,
        messages=[{"role": "user", "content": "hello there"}],
        presence_penalty=0.5,
        frequency_penalty=0.5,
        seed=7,
        logit_bias={"11": 5},
        max_completion_tokens=2,
        user="end-user-42",
        extra_body={
            "repetition_penalty": 1.1,
            "top_k": 20,
            "min_p": 0.05,
            "min_tokens": 1,
            "ignore_eos": False,
            "stop_token_ids": [3],
        },
    )
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage is not None and resp.usage.completion_tokens == 2
    row = ledger_row(stack.settings.database_url or "", resp.id)
    assert row is not None and row["end_user"] == "end-user-42"


@pytest.mark.parametrize(
    "extra, param, words",
    [
        ({"temprature": 0.5}, "temprature", "Unrecognized request argument supplied: temprature"),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
        ({"metadata": {"a": "b" * 513}}, "metadata", "length <= 512"),
        ({"top_logprobs": 2}, "top_logprobs", "logprobs"),
        ({"tool_choice": "required"}, "tool_choice", "tools"),
        ({"frequency_penalty": 3}, "frequency_penalty", "<= 2.0"),
        ({"n": 99}, "n", "n"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "schema"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
            "'x'",
        ),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_it(
    stack: Stack, sdk: OpenAI, extra: dict[str, Any], param: str, words: str
) -> None:
    with pytest.raises(BadRequestError) as err:
        sdk.chat.completions.create(
            model=stack.model, messages=[{"role": "user", "content": "hi"}], extra_body=extra
        )
    body = err.value.body
    assert isinstance(body, dict)
    assert param in (body.get("param") or ""), body
    assert words in body["message"], body


def test_an_unknown_field_inside_a_message_is_named(stack: Stack, client: httpx.Client) -> None:
    body = chat_body(stack.model, "hi")
    body["messages"][0]["colour"] = "red"
    resp = client.post("/v1/chat/completions", json=body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["message"].startswith("Unrecognized request argument supplied:")
    assert error["param"].endswith("colour")
    image = chat_body(stack.model, "hi")
    image["messages"][0]["content"] = [{"type": "image_url", "image_url": {"url": "x"}}]
    assert client.post("/v1/chat/completions", json=image).status_code == 400


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellms_body_is_taken_and_every_chunk_has_the_usage(
    stack: Stack, client: httpx.Client, route: str
) -> None:
    """What GuideLLM 0.8 sends, recorded from it: vLLM's continuous_usage_stats, text
    parts, ignore_eos; each chunk says the usage so far, the last the request's."""
    body: dict[str, Any] = {
        "model": stack.model,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "ignore_eos": True,
    }
    if route.startswith("/v1/chat"):
        body["messages"] = [{"role": "user", "content": [{"type": "text", "text": "a b c"}]}]
        body["max_completion_tokens"] = 6
    else:
        body["prompt"] = "a b c"
        body["max_tokens"] = 6
    _, events = read_all(client, "POST", route, json=body)
    chunks = [json.loads(e.data) for e in events if e.data.startswith("{")]
    assert all("usage" in c for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 6  # ignore_eos: to max_tokens
    final = chunks[-1]
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {final["usage"]["prompt_tokens"]}


@pytest.fixture(scope="module")
def llama_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    """A server told its model writes Llama 3.x JSON calls (LASTEVENT_TOOL_PARSER)."""
    with running(
        tmp_path_factory.mktemp("llama"),
        redis_url,
        database_url,
        model_dir,
        tool_parser="llama3_json",
    ) as st:
        yield st


def test_the_llama3_json_parser_is_a_setting(llama_stack: Stack) -> None:
    sdk = OpenAI(base_url=llama_stack.url + "/v1", api_key="unused", max_retries=0)
    calls = [
        {"name": "get_weather", "parameters": ARGS_1},
        {"name": "get_time", "parameters": ARGS_2},
    ]
    text = "; ".join(json.dumps(c, ensure_ascii=False) for c in calls)
    resp = sdk.chat.completions.create(
        model=llama_stack.model,
        messages=[{"role": "user", "content": text}],
        tools=[WEATHER, TIME],  # type: ignore[list-item]
    )
    got = resp.choices[0].message.tool_calls
    assert got is not None
    assert [(c.function.name, json.loads(c.function.arguments)) for c in got] == [  # type: ignore[union-attr]
        ("get_weather", ARGS_1),
        ("get_time", ARGS_2),
    ]
    assert resp.choices[0].message.content is None
    # plain text is content for that parser: no marker, no call
    plain = sdk.chat.completions.create(
        model=llama_stack.model,
        messages=[{"role": "user", "content": "It is sunny."}],
        tools=[WEATHER],  # type: ignore[list-item]
    )
    assert plain.choices[0].message.content == "It is sunny."
    assert plain.choices[0].finish_reason == "stop"
