"""OpenAI's Responses API through the unmodified openai SDK: background streams cut and
resumed with ``starting_after`` (the SDK's own resume), non-streaming create and
retrieve, cancel, function calling. The scripted engine echoes the last user message."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import httpx2
import pydantic
import pytest
from httpx_sse import EventSource
from openai import BadRequestError, NotFoundError, OpenAI, UnprocessableEntityError
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from service.store.keys import Keys
from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import LONG, ledger_row
from tests.e2e.test_chat_contract import ARGS_1, hermes

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
        "required": ["city"],
    },
}


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    # slow enough that a cancel lands while the answer is being written
    with running(
        tmp_path_factory.mktemp("responses"),
        redis_url,
        database_url,
        model_dir,
        apis=2,  # a stream resumed on the other replica
        scripted_tokens_per_s=100.0,
    ) as st:
        yield st


@pytest.fixture
def sdk(stack: Stack) -> OpenAI:
    return OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0)


def test_a_background_stream_cut_anywhere_resumes_with_starting_after(
    stack: Stack, sdk: OpenAI
) -> None:
    text = LONG[:300]
    first = sdk.responses.create(model=stack.model, input=text, background=True, stream=True)
    seen = []
    cut = random.Random(len(text)).randint(3, 40)
    for event in first:
        seen.append(event)
        if len(seen) == cut:
            break
    first.close()
    rid = seen[0].response.id  # type: ignore[union-attr]
    assert seen[0].type == "response.created"
    rest = list(sdk.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number))
    events = seen + rest
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == text
    final = sdk.responses.retrieve(rid)
    assert final.status == "completed" and final.output_text == text
    assert final.usage is not None and final.usage.output_tokens > 0
    # the whole stream again, from the start, is the same events
    again = list(sdk.responses.retrieve(rid, stream=True))
    assert [e.model_dump() for e in again] == [e.model_dump() for e in events]


def test_last_event_id_is_a_sequence_number(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.responses.create(model=stack.model, input="Zürich 東京 🤖")
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        whole = client.get(f"/v1/responses/{resp.id}", params={"stream": "true"}).text
        with client.stream(
            "GET",
            f"/v1/responses/{resp.id}",
            params={"stream": "true"},
            headers={"Last-Event-ID": "4"},
        ) as r:
            rest = list(EventSource(r).iter_sse())
    assert [int(e.id) for e in rest] == list(range(5, 5 + len(rest)))
    assert all(json.loads(e.data)["type"] == e.event for e in rest)
    assert whole.endswith(
        "".join(f"event: {e.event}\ndata: {e.data}\nid: {e.id}\n\n" for e in rest)
    )


@pytest.mark.parametrize("cursor", ["9" * 5000, "²", "-1", "4.0"])
def test_a_malformed_last_event_id_is_a_400(stack: Stack, sdk: OpenAI, cursor: str) -> None:
    resp = sdk.responses.create(model=stack.model, input="a cursor of nonsense")
    got = httpx.get(
        f"{stack.url}/v1/responses/{resp.id}",
        params={"stream": "true"},
        headers={"Last-Event-ID": cursor.encode()},  # (bytes: httpx sends them as they are)
        timeout=30,
    )
    assert got.status_code == 400, got.text
    assert got.json()["error"]["code"] == "invalid_event_id"


def test_non_streaming_create_and_retrieve(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.responses.create(
        model=stack.model,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello, €uro"}]}],
        instructions="Be brief.",
        max_output_tokens=64,
        metadata={"ticket": "42"},
    )
    assert resp.status == "completed"
    assert resp.output_text == "Hello, €uro"
    assert resp.instructions == "Be brief." and resp.metadata == {"ticket": "42"}
    assert resp.id.startswith("resp_")
    assert sdk.responses.retrieve(resp.id).model_dump() == resp.model_dump()


def test_max_output_tokens_is_incomplete(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.responses.create(model=stack.model, input=LONG, max_output_tokens=3)
    assert resp.status == "incomplete"
    assert resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"


def test_cancel_a_background_response(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.responses.create(model=stack.model, input=LONG * 3, background=True)
    assert resp.status in ("queued", "in_progress")
    cancelled = sdk.responses.cancel(resp.id)
    assert cancelled.status == "cancelled"
    assert sdk.responses.retrieve(resp.id).status == "cancelled"
    assert sdk.responses.cancel(resp.id).status == "cancelled"  # idempotent


def test_a_function_calling_round_trip(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.responses.create(
        model=stack.model,
        input=hermes("get_weather", ARGS_1),
        tools=[WEATHER],  # type: ignore[list-item]
    )
    [call] = [item for item in resp.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGS_1  # type: ignore[union-attr]
    follow = sdk.responses.create(
        model=stack.model,
        tools=[WEATHER],  # type: ignore[list-item]
        input=[
            {"role": "user", "content": "Weather in Zürich?"},
            {
                "type": "function_call",
                "call_id": call.call_id,  # type: ignore[union-attr]
                "name": call.name,  # type: ignore[union-attr]
                "arguments": call.arguments,  # type: ignore[union-attr]
            },
            {"type": "function_call_output", "call_id": call.call_id, "output": "12 °C"},  # type: ignore[union-attr]
        ],
    )
    # SmolLM2's template knows no tools: the tool's output is a Hermes-style user turn
    assert follow.output_text == "<tool_response>\n12 °C\n</tool_response>"


def test_streamed_function_call_arguments(stack: Stack, sdk: OpenAI) -> None:
    with sdk.responses.stream(
        model=stack.model,
        input=hermes("get_weather", ARGS_1),
        tools=[WEATHER],  # type: ignore[list-item]
    ) as stream:
        done = [e for e in stream if e.type == "response.function_call_arguments.done"]
        final = stream.get_final_response()
    assert [json.loads(e.arguments) for e in done] == [ARGS_1]
    assert final.status == "completed"


def test_what_cannot_be_honoured_is_a_400(stack: Stack, sdk: OpenAI) -> None:
    for extra, param in [
        ({"store": False, "background": True}, "store"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"input": []}, "input"),
        ({"input": [{"role": "user", "content": "x", "colour": 1}]}, "input.0.colour"),
        ({"input": [{"type": "web_search_call"}]}, "input.0.type"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
    ]:
        with pytest.raises(BadRequestError) as err:
            kw = {"input": "hi", **extra}
            sdk.responses.create(model=stack.model, **kw)  # type: ignore[call-overload]
        body = err.value.body
        assert isinstance(body, dict) and param in (body.get("param") or ""), body


def test_another_kind_of_request_is_not_a_response(stack: Stack) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        chat = client.post(
            "/v1/chat/completions",
            json={"model": stack.model, "messages": [{"role": "user", "content": "hi"}]},
        ).json()
        assert client.get(f"/v1/responses/{chat['id']}").status_code == 404


def test_a_chain_of_three_turns_with_previous_response_id(stack: Stack, sdk: OpenAI) -> None:
    one = sdk.responses.create(model=stack.model, input="one 1", instructions="Only once.")
    two = sdk.responses.create(model=stack.model, input="two 2", previous_response_id=one.id)
    three = sdk.responses.create(
        model=stack.model,
        input=[{"role": "user", "content": "three 3"}],
        previous_response_id=two.id,
    )
    assert three.output_text == "three 3"
    assert three.previous_response_id == two.id
    assert one.usage and two.usage and three.usage
    assert one.usage.input_tokens < two.usage.input_tokens < three.usage.input_tokens
    items = sdk.responses.input_items.list(three.id, order="asc")
    got = [(i.role, i.content[0].text) for i in items.data]  # type: ignore[union-attr]
    assert got == [
        ("user", "one 1"),
        ("assistant", "one 1"),
        ("user", "two 2"),
        ("assistant", "two 2"),
        ("user", "three 3"),
    ]
    newest = sdk.responses.input_items.list(three.id, limit=2)
    assert [i.content[0].text for i in newest.data] == ["three 3", "two 2"]  # type: ignore[union-attr]
    assert newest.has_more
    rest = sdk.responses.input_items.list(three.id, limit=10, after=newest.data[-1].id)
    assert [i.content[0].text for i in rest.data] == ["two 2", "one 1", "one 1"]  # type: ignore[union-attr]
    assert not rest.has_more


def test_previous_response_id_of_nothing_is_a_404(stack: Stack, sdk: OpenAI) -> None:
    with pytest.raises(NotFoundError) as err:
        sdk.responses.create(model=stack.model, input="hi", previous_response_id="resp_" + "0" * 32)
    assert isinstance(err.value.body, dict) and err.value.body["param"] == "previous_response_id"


def _archived(database_url: str, rid: str) -> bool:
    async def look() -> bool:
        engine = create_async_engine(database_url)
        try:
            async with engine.connect() as conn:
                found = await conn.execute(
                    text("SELECT 1 FROM archives WHERE request_id = :id"), {"id": rid}
                )
                return found.first() is not None
        finally:
            await engine.dispose()

    return asyncio.run(look())


def test_store_false_keeps_the_billing_row_only(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.responses.create(model=stack.model, input="not kept", store=False)
    assert resp.output_text == "not kept" and resp.store is False
    db = stack.settings.database_url or ""
    row = ledger_row(db, resp.id)
    assert row is not None and row["state"] == "finished"
    assert not _archived(db, resp.id)
    ttl = stack.store().ttl(Keys(stack.settings.key_prefix, stack.settings.partitions).log(resp.id))
    assert 0 < ttl <= stack.settings.unstored_ttl_s
    kept = sdk.responses.create(model=stack.model, input="kept")
    assert ledger_row(db, kept.id) is not None
    deadline = time.monotonic() + 15
    while not _archived(db, kept.id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _archived(db, kept.id)  # (the same path archives a stored one)
    with pytest.raises(BadRequestError):
        sdk.responses.create(model=stack.model, input="x", store=False, background=True)


def test_delete_removes_the_log_and_the_archive(stack: Stack, sdk: OpenAI) -> None:
    done = sdk.responses.create(model=stack.model, input="to be deleted")
    running = sdk.responses.create(model=stack.model, input=LONG * 3, background=True)
    db = stack.settings.database_url or ""
    for rid in (done.id, running.id):
        gone = sdk.responses.delete(rid)
        assert gone is None or getattr(gone, "deleted", True)
        with pytest.raises(NotFoundError):
            sdk.responses.retrieve(rid)
        assert not _archived(db, rid)
        row = ledger_row(db, rid)  # billing keeps its row
        assert row is not None
    assert ledger_row(db, running.id)["state"] == "cancelled"  # type: ignore[index]
    with pytest.raises(NotFoundError):
        sdk.responses.delete(done.id)


def test_a_background_response_runs_with_no_reader(stack: Stack, sdk: OpenAI) -> None:
    made = sdk.responses.create(model=stack.model, input="nobody waits", background=True)
    assert made.status in ("queued", "in_progress") and made.background is True
    deadline = time.monotonic() + 60
    while (got := sdk.responses.retrieve(made.id)).status != "completed":
        assert time.monotonic() < deadline, got.status
        time.sleep(0.1)
    assert got.output_text == "nobody waits"


def test_an_archived_response_streams_the_same_bytes(stack: Stack, sdk: OpenAI) -> None:
    resp = sdk.responses.create(model=stack.model, input="Zürich 東京 🤖, archived")
    db = stack.settings.database_url or ""
    assert ledger_row(db, resp.id) is not None
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        hot = client.get(f"/v1/responses/{resp.id}", params={"stream": "true"}).content
        hot_object = client.get(f"/v1/responses/{resp.id}").content
        deadline = time.monotonic() + 15
        while not _archived(db, resp.id):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        keys = Keys(stack.settings.key_prefix, stack.settings.partitions)
        stack.store().delete(keys.log(resp.id), keys.meta(resp.id))  # the hot log's TTL, now
        cold = client.get(f"/v1/responses/{resp.id}", params={"stream": "true"}).content
        assert cold == hot
        assert client.get(f"/v1/responses/{resp.id}").content == hot_object
        after = client.get(
            f"/v1/responses/{resp.id}", params={"stream": "true", "starting_after": 5}
        )
        assert hot.endswith(after.content.split(b"\n", 1)[1])  # (after its retry: line)


class City(pydantic.BaseModel):
    city: str
    population: int


def test_text_format_json_schema_parses_into_the_model(stack: Stack, sdk: OpenAI) -> None:
    text = json.dumps({"city": "Zürich", "population": 423000}, ensure_ascii=False)
    parsed = sdk.responses.parse(model=stack.model, input=text, text_format=City)
    assert parsed.output_parsed == City(city="Zürich", population=423000)
    assert parsed.text.format.type == "json_schema"  # type: ignore[union-attr]


class _CutFirstPost(httpx2.HTTPTransport):
    """The server answers the first POST, but its answer never reaches the client: the
    connection breaks before the headers are read (what a flaky network does)."""

    def __init__(self) -> None:
        super().__init__()
        self.cut: list[str] = []  # the request ids the client never saw
        self.keys: list[str | None] = []  # the Idempotency-Key of every POST

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        response = super().handle_request(request)
        if request.method == "POST":
            self.keys.append(request.headers.get("idempotency-key"))
            if not self.cut:
                response.read()
                response.close()
                self.cut.append(response.headers["x-request-id"])
                raise httpx2.ReadError("cut before the answer arrived", request=request)
        return response


def test_a_background_response_cut_before_its_headers_is_found_again_by_its_key(
    stack: Stack,
) -> None:
    """The official SDK's idempotency: with its idempotency header named, every POST gets a
    key (``idempotency_key``), the same on each retry. The first POST's answer is lost;
    the SDK's retry with the same key answers that same response, not a second one."""
    transport = _CutFirstPost()
    with OpenAI(
        base_url=stack.url + "/v1",
        api_key="unused",
        max_retries=2,
        http_client=httpx2.Client(transport=transport),
    ) as sdk:
        sdk._idempotency_header = "Idempotency-Key"  # what a Stainless SDK names to send them
        raw = sdk.responses.with_raw_response.create(
            model=stack.model, input="made once, found twice", background=True
        )
        made = raw.parse()
        assert transport.cut and made.id == transport.cut[0]  # the one the first POST made
        assert raw.headers["idempotent-replayed"] == "true"
        assert len(transport.keys) == 2 and transport.keys[0] and len(set(transport.keys)) == 1
        deadline = time.monotonic() + 60
        while (got := sdk.responses.retrieve(made.id)).status != "completed":
            assert time.monotonic() < deadline, got.status
            time.sleep(0.1)
    assert got.output_text == "made once, found twice"


def test_idempotent_responses_stream_again_and_refuse_another_body(
    stack: Stack, sdk: OpenAI
) -> None:
    """``Idempotency-Key`` as on chat completions: the same body again streams the same
    response from its start (after ``Last-Event-ID``: the rest); another body is a 422."""
    key = {"Idempotency-Key": f"resp-{random.getrandbits(64):x}"}
    first = list(
        sdk.responses.create(model=stack.model, input=LONG, stream=True, extra_headers=key)
    )
    rid = first[0].response.id  # type: ignore[union-attr]
    again = sdk.responses.with_raw_response.create(
        model=stack.model, input=LONG, stream=True, extra_headers=key
    )
    assert again.headers["idempotent-replayed"] == "true"
    replayed = list(again.parse())
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in first]
    assert replayed[-1].response.id == rid  # type: ignore[union-attr]
    with (
        httpx.Client(base_url=stack.url, timeout=30) as client,
        client.stream(
            "POST",
            "/v1/responses",
            json={"model": stack.model, "input": LONG, "stream": True},
            headers={**key, "Last-Event-ID": str(first[4].sequence_number)},
        ) as r,
    ):
        rest = [e for e in EventSource(r).iter_sse() if e.data]
    assert [json.loads(e.data)["sequence_number"] for e in rest] == [
        e.sequence_number for e in first[5:]
    ]
    with pytest.raises(UnprocessableEntityError) as refused:
        sdk.responses.create(model=stack.model, input="another body", extra_headers=key)
    assert refused.value.code == "idempotency_key_reused"


def test_sampling_fields_pass_on_and_the_penalties_are_echoed(stack: Stack, sdk: OpenAI) -> None:
    """Open Responses' penalties (not in the SDK's signature) and vLLM's extensions of the
    Responses request (``stop``, ``ignore_eos``, ``top_k``, ``seed``... -- what ``vllm bench
    serve`` sends) reach the engine as a chat request's; only the spec's are echoed."""
    cut = LONG.split()[3]
    extra = {"presence_penalty": 0.5, "stop": [cut], "ignore_eos": False, "top_k": 5, "seed": 7}
    resp = sdk.responses.create(model=stack.model, input=LONG, extra_body=extra)
    assert resp.status == "completed"
    assert resp.output_text == LONG[: LONG.index(cut)]  # the stop string ended it
    assert (resp.presence_penalty, resp.frequency_penalty) == (0.5, 0.0)
    assert "top_k" not in (resp.model_extra or {}) and "stop" not in (resp.model_extra or {})
    with pytest.raises(BadRequestError) as err:
        sdk.responses.create(model=stack.model, input="hi", extra_body={"frequency_penalty": 3})
    body = err.value.body
    assert isinstance(body, dict) and body.get("param") == "frequency_penalty", body
