"""Every object and streaming event the OpenAI-compatible routes produce, validated
against the published OpenAPI specs vendored in ``tests/specs/`` (see its README):
OpenAI's for chat completions, completions and error bodies, Open Responses' for the
Responses API's objects and events. Nullable-required fields must be there as null.

Requests go to a real stack (scripted engine: it echoes the last user message, and a
Hermes ``<tool_call>`` in it becomes a tool call); a hypothesis property sends generated
requests of every route, streaming or not, and checks whatever comes back."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator

from tests.e2e.conftest import Stack
from tests.e2e.test_chat_contract import ARGS_1, hermes
from tests.e2e.test_responses import WEATHER

SPECS = Path(__file__).parent.parent / "specs"
CHAT_TOOL = {
    "type": "function",
    "function": {k: WEATHER[k] for k in ("name", "description", "parameters")},
}
# Responses events without a schema of their own in the spec: what their payload is
UNSPECIFIED_EVENTS = {"response.cancelled": "ResponseResource"}  # (OpenAI's webhook name)


def _nullable(node: Any) -> Any:
    """OpenAPI 3.0's ``nullable: true`` (still in OpenAI's 3.1 file) as JSON Schema's
    "or null", on a copy."""
    if isinstance(node, list):
        return [_nullable(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _nullable(v) for k, v in node.items() if k != "nullable"}
    if node.get("nullable") is True:
        if "$ref" in out or "allOf" in out or "type" not in out:
            return {"anyOf": [out, {"type": "null"}]}
        kind = out["type"]
        out["type"] = [*kind, "null"] if isinstance(kind, list) else [kind, "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out


class Spec:
    """One vendored spec's component schemas, each a validator on demand."""

    def __init__(self, file: str) -> None:
        doc = json.loads((SPECS / file).read_text())
        self.components = _nullable(doc["components"])
        self._validators: dict[str, Draft202012Validator] = {}

    def errors(self, name: str, data: Any) -> list[str]:
        if name not in self.components["schemas"]:
            return [f"no schema {name!r} in the spec"]
        if name not in self._validators:
            root = {"components": self.components, "$ref": f"#/components/schemas/{name}"}
            self._validators[name] = Draft202012Validator(root)
        found = self._validators[name].iter_errors(data)
        return [f"{name} at {'/'.join(map(str, e.absolute_path))}: {e.message}" for e in found]


OPENAI = Spec("openai.openapi.extract.json")
# OpenAI's spec has no schema for a streamed completion's chunk: its own streams send
# CreateCompletionResponse objects whose finish_reason is null until the last one. This
# test's own schema, derived here: that one with a nullable finish_reason.
COMPLETION_CHUNK = "CreateCompletionResponse (a streamed chunk)"
_chunk = copy.deepcopy(OPENAI.components["schemas"]["CreateCompletionResponse"])
_reason = _chunk["properties"]["choices"]["items"]["properties"]
_reason["finish_reason"] = {"anyOf": [_reason["finish_reason"], {"type": "null"}]}
OPENAI.components["schemas"][COMPLETION_CHUNK] = _chunk
OPEN_RESPONSES = Spec("openresponses.openapi.json")


def assert_valid(spec: Spec, name: str, data: Any) -> None:
    problems = spec.errors(name, data)
    assert not problems, json.dumps(data)[:2000] + "\n" + "\n".join(problems[:20])


def event_schema(type_: str) -> str:
    """``response.output_text.delta`` -> ``ResponseOutputTextDeltaStreamingEvent``."""
    if type_ == "error":
        return "ErrorStreamingEvent"
    words = re.split(r"[._]", type_)
    return "".join(w.capitalize() for w in words) + "StreamingEvent"


def sse_payloads(body: str) -> list[str]:
    """The ``data`` of each SSE message (``id:``, ``event:``, ``retry:`` and comments
    aside)."""
    out = []
    for message in body.replace("\r\n", "\n").split("\n\n"):
        data = [line[5:].removeprefix(" ") for line in message.split("\n") if line[:5] == "data:"]
        if data:
            out.append("\n".join(data))
    return out


def check_error(r: httpx.Response) -> None:
    assert r.status_code >= 400, r.text
    assert_valid(OPENAI, "ErrorResponse", r.json())


def check_openai(r: httpx.Response, kind: str, stream: bool) -> int:
    """A chat completion's or completion's answer, streamed or not; the count checked."""
    if r.status_code != 200:
        check_error(r)
        return 1
    name = "CreateChatCompletionResponse" if kind == "chat" else "CreateCompletionResponse"
    if not stream:
        assert_valid(OPENAI, name, r.json())
        return 1
    name = "CreateChatCompletionStreamResponse" if kind == "chat" else COMPLETION_CHUNK
    payloads = sse_payloads(r.text)
    for payload in payloads:
        if payload == "[DONE]":
            continue
        chunk = json.loads(payload)
        assert_valid(OPENAI, "ErrorResponse" if "error" in chunk else name, chunk)
    return len(payloads)


def check_responses(r: httpx.Response, stream: bool) -> int:
    """A Responses answer: the response object, or every event of its stream."""
    if r.status_code != 200:
        check_error(r)
        return 1
    if not stream:
        assert_valid(OPEN_RESPONSES, "ResponseResource", r.json())
        return 1
    payloads = sse_payloads(r.text)
    for payload in payloads:
        event = json.loads(payload)
        if event["type"] in UNSPECIFIED_EVENTS:
            assert_valid(OPEN_RESPONSES, UNSPECIFIED_EVENTS[event["type"]], event["response"])
        else:
            assert_valid(OPEN_RESPONSES, event_schema(event["type"]), event)
    return len(payloads)


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=60) as c:
        yield c


def chat(
    client: httpx.Client, stack: Stack, text: str, *, stream: bool, **extra: Any
) -> httpx.Response:
    body = {"model": stack.model, "messages": [{"role": "user", "content": text}], **extra}
    return client.post("/v1/chat/completions", json={**body, "stream": stream})


def respond(client: httpx.Client, body: dict[str, Any]) -> httpx.Response:
    return client.post("/v1/responses", json=body)


# chat completions and completions


@pytest.mark.parametrize("stream", [False, True])
def test_chat_text(stack: Stack, client: httpx.Client, stream: bool) -> None:
    r = chat(client, stack, "Hello there", stream=stream, stream_options=None)
    assert r.status_code == 200
    if not stream:
        message = r.json()["choices"][0]["message"]
        assert message["refusal"] is None and message["annotations"] == []
    assert check_openai(r, "chat", stream) >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_chat_usage_logprobs_and_two_choices(
    stack: Stack, client: httpx.Client, stream: bool
) -> None:
    extra: dict[str, Any] = {"n": 2, "logprobs": True, "top_logprobs": 2}
    if stream:
        extra["stream_options"] = {"include_usage": True}
    r = chat(client, stack, "Café 日本", stream=stream, **extra)
    assert r.status_code == 200
    check_openai(r, "chat", stream)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_tool_call(stack: Stack, client: httpx.Client, stream: bool) -> None:
    r = chat(client, stack, hermes("get_weather", ARGS_1), stream=stream, tools=[CHAT_TOOL])
    assert r.status_code == 200
    assert '"tool_calls"' in r.text
    check_openai(r, "chat", stream)


@pytest.mark.parametrize("stream", [False, True])
def test_completion(stack: Stack, client: httpx.Client, stream: bool) -> None:
    body = {"model": stack.model, "prompt": "Once upon", "stream": stream, "logprobs": 1}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200
    check_openai(r, "completion", stream)


def test_error_bodies(stack: Stack, client: httpx.Client) -> None:
    bad = [
        ("/v1/chat/completions", {"model": stack.model, "messages": []}),
        ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user"}]}),
        ("/v1/completions", {"model": stack.model, "prompt": "x", "unknown_field": 1}),
        ("/v1/responses", {"model": stack.model, "input": []}),
        ("/v1/responses", {"model": "no-such-model", "input": "hi"}),
        ("/v1/responses/compact", {"input": "hi"}),
        ("/v1/responses/compact", {"model": stack.model}),
    ]
    for path, body in bad:
        check_error(client.post(path, json=body))
    check_error(client.get("/v1/responses/resp_nonesuch"))


# the Responses API


@pytest.mark.parametrize("stream", [False, True])
def test_responses_text(stack: Stack, client: httpx.Client, stream: bool) -> None:
    body = {"model": stack.model, "input": "Hello", "stream": stream, "instructions": "Be brief"}
    r = respond(client, body)
    assert r.status_code == 200
    check_responses(r, stream)
    rid = r.json()["id"] if not stream else json.loads(sse_payloads(r.text)[0])["response"]["id"]
    got = client.get(f"/v1/responses/{rid}")
    check_responses(got, stream=False)
    check_responses(client.get(f"/v1/responses/{rid}", params={"stream": "true"}), stream=True)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_tool_call(stack: Stack, client: httpx.Client, stream: bool) -> None:
    body = {
        "model": stack.model,
        "input": hermes("get_weather", ARGS_1),
        "tools": [WEATHER],
        "stream": stream,
    }
    r = respond(client, body)
    assert r.status_code == 200 and "function_call" in r.text
    check_responses(r, stream)


@pytest.mark.parametrize("stream", [False, True])
def test_responses_incomplete_and_phase(stack: Stack, client: httpx.Client, stream: bool) -> None:
    body = {
        "model": stack.model,
        "input": [
            {"type": "message", "role": "assistant", "phase": "commentary", "content": "Hm."},
            {"type": "message", "role": "assistant", "phase": "final_answer", "content": "4."},
            {"type": "message", "role": "user", "content": "A rather long answer, please"},
        ],
        "max_output_tokens": 2,
        "stream": stream,
    }
    r = respond(client, body)
    assert r.status_code == 200
    check_responses(r, stream)
    rid = r.json()["id"] if not stream else json.loads(sse_payloads(r.text)[0])["response"]["id"]
    items = client.get(f"/v1/responses/{rid}/input_items", params={"order": "asc"}).json()
    assert [i.get("phase") for i in items["data"]] == ["commentary", "final_answer", None]
    for item in items["data"]:
        assert_valid(OPEN_RESPONSES, "ItemField", item)


def test_compaction_and_its_item_as_input(stack: Stack, client: httpx.Client) -> None:
    talk = [
        {"type": "message", "role": "user", "content": "We launch on Tuesday."},
        {"type": "message", "role": "assistant", "content": "Tuesday it is."},
    ]
    r = client.post("/v1/responses/compact", json={"model": stack.model, "input": talk})
    assert r.status_code == 200, r.text
    compacted = r.json()
    assert_valid(OPEN_RESPONSES, "CompactResource", compacted)
    assert [i["type"] for i in compacted["output"]] == ["compaction"]
    # the scripted engine echoes the last user turn: the ask for the summary
    assert compacted["output"][0]["encrypted_content"] == "Summarise the conversation above."
    then = [*compacted["output"], {"type": "message", "role": "user", "content": "When?"}]
    for stream in (False, True):
        body = {"model": stack.model, "input": then, "stream": stream}
        r = respond(client, body)
        check_responses(r, stream)
    rid = json.loads(sse_payloads(r.text)[0])["response"]["id"]
    items = client.get(f"/v1/responses/{rid}/input_items", params={"order": "asc"}).json()
    assert [i["type"] for i in items["data"]] == ["compaction", "message"]
    for item in items["data"]:
        assert_valid(OPEN_RESPONSES, "ItemField", item)


def test_responses_background_and_cancel(stack: Stack, client: httpx.Client) -> None:
    body = {"model": stack.model, "input": "x " * 200, "background": True, "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as r:
        assert r.status_code == 200
        seen = ""
        for text in r.iter_text():
            seen += text
            if "\n\n" in seen and sse_payloads(seen):
                break
    rid = json.loads(sse_payloads(seen)[0])["response"]["id"]
    cancelled = client.post(f"/v1/responses/{rid}/cancel")
    check_responses(cancelled, stream=False)
    check_responses(client.get(f"/v1/responses/{rid}", params={"stream": "true"}), stream=True)


# the property: generated requests, whatever they answer, answer as the specs say

WORDS = st.text(st.characters(codec="utf-8", exclude_categories=["Cs", "Cc"]), max_size=24)
SAMPLING = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from([0.0, 0.7, 2.0, 3.5]),
        "top_p": st.sampled_from([0.5, 1.0]),
    },
)


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, str, dict[str, Any], bool]:
    route = draw(st.sampled_from(["chat", "completion", "responses", "compact"]))
    stream = draw(st.booleans())
    text = draw(st.one_of(WORDS, st.just(hermes("get_weather", ARGS_1))))
    tools = draw(st.booleans())
    body: dict[str, Any] = {"stream": stream, **draw(SAMPLING)}
    limit = draw(st.none() | st.integers(0, 6))
    if route == "chat":
        body["messages"] = [{"role": "user", "content": text}]
        body["tools"] = [CHAT_TOOL] if tools else None
        body["max_completion_tokens"] = limit
        if stream and draw(st.booleans()):
            body["stream_options"] = {"include_usage": True}
    elif route == "completion":
        body.update(prompt=text, max_tokens=limit)
    elif route == "compact":  # (never streamed)
        return route, text, {"input": text, "instructions": draw(st.none() | WORDS)}, False
    else:
        body.update(input=text, max_output_tokens=limit)
        if tools:
            body["tools"] = [WEATHER]
    return route, text, body, stream


PATHS = {"chat": "/v1/chat/completions", "completion": "/v1/completions"}


@given(request=requests())
@settings(
    max_examples=25,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
def test_generated_requests_answer_as_the_specs_say(
    stack: Stack, client: httpx.Client, request: tuple[str, str, dict[str, Any], bool]
) -> None:
    route, _, body, stream = request
    body = {"model": stack.model, **{k: v for k, v in body.items() if v is not None}}
    note(json.dumps(body))
    if route == "responses":
        check_responses(respond(client, body), stream)
    elif route == "compact":
        r = client.post("/v1/responses/compact", json=body)
        if r.status_code == 200:
            assert_valid(OPEN_RESPONSES, "CompactResource", r.json())
        else:
            check_error(r)
    else:
        check_openai(client.post(PATHS[route], json=body), route, stream)
