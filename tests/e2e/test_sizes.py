"""Issue 41, sizes: every field that is stored or templated is bounded (a 400 naming
it), counts are checked before any chat template or tokenizer runs, a
``previous_response_id`` chain cannot grow its stored input past one body's bound, and
a large body is templated and tokenized off the API's event loop.

The bounds are ``service/stream/limits.py``'s; each test would have been accepted (or
refused for another reason) before them.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.settings import MODEL_NAME
from service.stream import limits
from tests.e2e.conftest import Stack, running

USER = {"role": "user", "content": "hi"}
BIG_SCHEMA = {
    "type": "object",
    "properties": {f"field_{i}": {"type": "string"} for i in range(800)},
}  # about 25 KB as JSON


@pytest.fixture(scope="module")
def client(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=60) as c:
        yield c


def refused(resp: httpx.Response, param: str, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text[:500]
    err: dict[str, Any] = resp.json()["error"]
    assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def chat(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": MODEL_NAME, **body})


def respond(client: httpx.Client, **body: Any) -> httpx.Response:
    return client.post("/v1/responses", json={"model": MODEL_NAME, **body})


def test_message_counts_are_checked_before_the_template(client: httpx.Client) -> None:
    """2,049 one-token messages: before, the template ran and the tokenizer counted past
    the context (context_length_exceeded); now the count alone refuses them."""
    many = [USER] * (limits.MAX_MESSAGES + 1)
    err = refused(chat(client, messages=many), "messages", "too_many_entries")
    assert str(limits.MAX_MESSAGES) in err["message"]
    items = [{"type": "message", **USER}] * (limits.MAX_MESSAGES + 1)
    refused(respond(client, input=items), "input", "too_many_entries")
    resp = client.post("/tokenize", json={"model": MODEL_NAME, "messages": many})
    refused(resp, "messages", "too_many_entries")
    assert chat(client, messages=[USER] * 8, max_tokens=2).status_code == 200


@pytest.mark.parametrize(
    ("item", "param"),
    [
        ({"type": "message", "id": "m" * 129, **USER}, "input.0.id"),
        ({"type": "message", "id": "msg bad!", **USER}, "input.0.id"),
        ({"type": "message", "status": "whatever", **USER}, "input.0.status"),
        ({"type": "message", "status": "x" * 100_000, **USER}, "input.0.status"),
        (
            {"type": "function_call", "call_id": "c" * 257, "name": "f", "arguments": "{}"},
            "input.0.call_id",
        ),
        (
            {"type": "function_call", "call_id": "call_1", "name": "not a name", "arguments": "{}"},
            "input.0.name",
        ),
        ({"type": "function_call_output", "call_id": "call 1", "output": "ok"}, "input.0.call_id"),
        ({"type": "function_call_output", "call_id": "call_1", "output": 7}, "input.0.output"),
    ],
)
def test_response_input_item_fields_are_bounded(
    client: httpx.Client, item: dict[str, Any], param: str
) -> None:
    """Before: stored whole (and copied into every later turn of the conversation)."""
    refused(respond(client, input=[item, {"type": "message", **USER}]), param)


def test_well_formed_item_ids_and_statuses_are_accepted(client: httpx.Client) -> None:
    item = {"type": "message", "id": "msg_" + "a" * 48, "status": "completed", **USER}
    resp = respond(client, input=[item], max_output_tokens=2)
    assert resp.status_code == 200, resp.text


def test_chat_ids_and_names_are_bounded(client: httpx.Client) -> None:
    call = {"id": "c" * 257, "type": "function", "function": {"name": "f", "arguments": "{}"}}
    assistant = {"role": "assistant", "tool_calls": [call]}
    err = refused(chat(client, messages=[USER, assistant]), "messages[1].tool_calls[0].id")
    assert err["type"] == "invalid_request_error"
    calls = [{**call, "id": f"call_{i}"} for i in range(limits.MAX_TOOL_CALLS + 1)]
    refused(
        chat(client, messages=[USER, {**assistant, "tool_calls": calls}]), "messages[1].tool_calls"
    )
    tool = {"role": "tool", "tool_call_id": "x" * 300, "content": "ok"}
    refused(chat(client, messages=[USER, tool]), "messages[1].tool_call_id")
    refused(chat(client, messages=[{**USER, "name": "n" * 65}]), "messages[0].name")


def test_tools_are_bounded_in_count_and_size(client: httpx.Client) -> None:
    def tool(i: int, parameters: dict[str, Any] | None = None) -> dict[str, Any]:
        return {"type": "function", "function": {"name": f"f{i}", "parameters": parameters or {}}}

    many = [tool(i) for i in range(limits.MAX_TOOLS + 1)]
    refused(chat(client, messages=[USER], tools=many), "tools", "too_many_entries")
    big = [tool(0), tool(1, BIG_SCHEMA)]
    refused(chat(client, messages=[USER], tools=big), "tools.1", "too_large")
    flat = [{"type": "function", **t["function"]} for t in big]
    refused(respond(client, input="hi", tools=flat), "tools.1", "too_large")
    flat_many = [{"type": "function", **t["function"]} for t in many]
    refused(respond(client, input="hi", tools=flat_many), "tools", "too_many_entries")


def test_output_schemas_are_bounded(client: httpx.Client) -> None:
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": BIG_SCHEMA}}
    refused(
        chat(client, messages=[USER], response_format=fmt),
        "response_format.json_schema.schema",
        "too_large",
    )
    text = {"format": {"type": "json_schema", "name": "big", "schema": BIG_SCHEMA}}
    refused(respond(client, input="hi", text=text), "text.format.schema", "too_large")
    bad_name = {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}
    refused(
        chat(client, messages=[USER], response_format=bad_name), "response_format.json_schema.name"
    )


# -- a conversation through previous_response_id ---------------------------------------


@pytest.fixture(scope="module")
def small_bodies(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("small-bodies"),
        redis_url,
        database_url,
        model_dir,
        max_body_bytes=30_000,
    ) as st:
        yield st


def test_a_chain_cannot_store_more_than_one_body(small_bodies: Stack) -> None:
    """Each turn fits the body bound, and the conversation fits the context; the third
    turn's accumulated input would be past one body's bound: refused, not stored.
    Before, every turn was accepted and stored the whole conversation again."""
    text = "hello world " * 900  # 10.8 KB, about 1,800 tokens
    with httpx.Client(base_url=small_bodies.url, timeout=60) as c:
        previous = None
        for turn in range(2):
            body: dict[str, Any] = {"input": text, "max_output_tokens": 4}
            if previous is not None:
                body["previous_response_id"] = previous
            resp = respond(c, **body)
            assert resp.status_code == 200, (turn, resp.text[:300])
            previous = resp.json()["id"]
        resp = respond(c, input=text, previous_response_id=previous, max_output_tokens=4)
        err = refused(resp, "previous_response_id", "conversation_too_large")
        assert "30000" in err["message"]


# -- a large body, templated and tokenized off the event loop ----------------------------


@pytest.fixture(scope="module")
def large_bodies(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("large-bodies"),
        redis_url,
        database_url,
        model_dir,
        max_body_bytes=12_000_000,
    ) as st:
        yield st


RENDERED_ANSWERS = 10  # /metrics answers seen during the render (a few ms each; it takes seconds)


def rendering(client: httpx.Client) -> float:
    """The API's ``lastevent_prompts_rendering`` gauge."""
    for line in client.get("/metrics").text.splitlines():
        if line.startswith("lastevent_prompts_rendering "):
            return float(line.split()[1])
    raise AssertionError("no lastevent_prompts_rendering in /metrics")


def test_the_event_loop_answers_while_a_large_body_is_tokenized(large_bodies: Stack) -> None:
    """2,000 messages of 5 KB: the tokenizer takes seconds over them. While it does, the
    same process answers /metrics, time and again (each saying a render is under way),
    and /healthz; the large request's answer (its context is exceeded) comes after those.
    Before, the template and tokenizer ran on the event loop, and then tokenizers' encode
    held the GIL on the render thread: the first /metrics asked during the render was
    answered at its end, and one or two more in its last moments (when it made the list
    of ids), so ``RENDERED_ANSWERS`` answers cannot come from that tail."""
    messages = [{"role": "user", "content": "hello world " * 420}] * 2000
    answered: list[str] = []
    done = threading.Event()

    def large() -> httpx.Response:
        with httpx.Client(base_url=large_bodies.url, timeout=300) as c:
            try:
                return chat(c, messages=messages)
            finally:
                answered.append("large")
                done.set()

    with (
        concurrent.futures.ThreadPoolExecutor(1) as pool,
        httpx.Client(base_url=large_bodies.url, timeout=300) as probe,
    ):
        future = pool.submit(large)
        while not done.is_set():
            if rendering(probe) >= 1 and not done.is_set():
                answered.append("metrics while rendering")
            if answered.count("metrics while rendering") == RENDERED_ANSWERS:
                assert probe.get("/healthz").status_code == 200
                answered.append("healthz")
                break
        resp = future.result()
    want = ["metrics while rendering"] * RENDERED_ANSWERS + ["healthz", "large"]
    assert answered[: RENDERED_ANSWERS + 2] == want, answered
    refused(resp, "messages", "context_length_exceeded")
