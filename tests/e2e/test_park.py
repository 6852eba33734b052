"""Park, don't burn: a request whose readers are gone leaves the engine after the park
delay, and a reader that comes back within the resume window gets the whole answer.

One worker (scripted engine at 40 tokens/s: an answer takes several seconds), two API
processes; a reader-less request is parked after 0.5 s. The scripted engine echoes the
prompt, so the whole answer is known: a continuation (re-prefill of the prompt and the
logged ids) must give exactly the text an uninterrupted run gives. Latencies are printed
(`-s`), never asserted: the tests assert states, texts, event ids and billing rows.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource
from openai import OpenAI

from service.store.keys import EVENT_FIELD, Keys, principal
from service.stream import events as ev
from service.stream.lifecycle import Meta
from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import (
    LONG,
    assert_ids_increase,
    chat_body,
    content_of,
    finish_reason,
    ledger_row,
    read_all,
    read_some,
    wait_state,
)

RATE = 40.0
PARK_AFTER_S = 0.5


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("park"),
        redis_url,
        database_url,
        model_dir,
        apis=2,
        scripted_tokens_per_s=RATE,
        scripted_prefill_s=0.2,
        park_after_s=PARK_AFTER_S,
        presence_check_s=0.2,
        lease_refresh_s=0.5,
        lease_ttl_s=2.0,
        sweep_interval_s=0.5,
        cancel_wait_s=10.0,
    ) as st:
        yield st


def meta(stack: Stack, rid: str) -> dict[str, str]:
    keys = Keys(stack.settings.key_prefix, stack.settings.partitions)
    raw = stack.store().hgetall(keys.meta(rid))
    return {k.decode(): v.decode(errors="replace") for k, v in raw.items()}


def log_deltas(stack: Stack, rid: str) -> list[ev.Delta]:
    """The log's deltas, read from Redis (not by a reader: that would make it go on)."""
    keys = Keys(stack.settings.key_prefix, stack.settings.partitions)
    entries = stack.store().xrange(keys.log(rid))
    events = [ev.decode(fields[EVENT_FIELD]) for _, fields in entries]
    return [e for e in events if isinstance(e, ev.Delta)]


def parked(stack: Stack, rid: str) -> dict[str, Any]:
    """Wait until ``rid`` is parked; its status then."""
    status = wait_state(stack.api_urls[1], rid, {"parked", "finished"})
    assert status["state"] == "parked", status
    return status


def test_a_reader_back_after_the_park_gets_the_whole_answer(stack: Stack) -> None:
    payload = chat_body(stack.model, LONG, stream=True, stream_options={"include_usage": True})
    rid, seen, left_at = read_some(stack.api_urls[0], payload, 6)
    at_park = parked(stack, rid)
    print(f"\npark: last reader left -> parked, seen {time.time() - left_at:.2f} s later")
    # out of the engine: its log does not grow while parked
    events_then = meta(stack, rid)[Meta.EVENTS]
    time.sleep(1.0)  # (an event that must not happen: more entries while nobody reads)
    assert meta(stack, rid)[Meta.EVENTS] == events_then
    assert at_park["finish_reason"] is None
    with httpx.Client(base_url=stack.api_urls[1], timeout=60) as client:
        _, rest = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": seen[-1].id}
        )
    assert content_of(seen + rest) == LONG  # the greedy text, whole: no gap, no repeat
    assert_ids_increase(seen + rest)
    assert finish_reason(rest) == "stop" and rest[-1].data == "[DONE]"
    row = ledger_row(stack.settings.database_url or "", rid)
    assert row is not None and row["state"] == "finished" and row["finish_reason"] == "stop"
    m = meta(stack, rid)
    assert int(m[Meta.PARKS]) == 1
    # what the parked run made and the log did not carry was made again: wasted, exactly
    assert row["wasted_tokens"] == int(m.get(Meta.DISCARDED, 0))
    assert row["reprefill_tokens"] > 0  # the continuation prefilled the prompt and the log
    usage = json.loads(next(e.data for e in reversed(rest) if '"usage"' in e.data))["usage"]
    assert usage["completion_tokens"] == row["completion_tokens"]


def test_text_completions_park_and_go_on(stack: Stack) -> None:
    payload = {"model": stack.model, "prompt": LONG, "stream": True}
    rid, seen, _ = read_some(stack.api_urls[0], payload, 4, path="/v1/completions")
    parked(stack, rid)
    with httpx.Client(base_url=stack.api_urls[0], timeout=60) as client:
        _, rest = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": seen[-1].id}
        )
    assert content_of(seen + rest) == LONG
    assert finish_reason(rest) == "stop"


def test_a_responses_stream_parks_and_the_sdk_resumes_it(stack: Stack) -> None:
    with OpenAI(base_url=stack.api_urls[0] + "/v1", api_key="unused", max_retries=0) as sdk:
        stream = sdk.responses.create(model=stack.model, input=LONG, stream=True)
        seen = []
        for event in stream:
            seen.append(event)
            if len(seen) == 8:
                break
        stream.close()
        rid = seen[0].response.id  # type: ignore[union-attr]
        parked(stack, rid)
        rest = list(
            sdk.responses.retrieve(rid, stream=True, starting_after=seen[-1].sequence_number)
        )
    numbers = [e.sequence_number for e in seen + rest]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))
    deltas = [e.delta for e in seen + rest if e.type == "response.output_text.delta"]
    assert "".join(deltas) == LONG
    assert rest[-1].type == "response.completed"
    assert rest[-1].response.output_text == LONG  # type: ignore[union-attr]


def test_a_non_streaming_client_that_gave_up_gets_it_on_its_retry(stack: Stack) -> None:
    """The idempotent POST again after the client's timeout: parked meanwhile, it goes on,
    and the retry's answer is the whole one."""
    body = chat_body(stack.model, LONG)
    key = f"park-{time.monotonic_ns()}"
    headers = {"Idempotency-Key": key}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            stack.api_urls[0] + "/v1/chat/completions", json=body, headers=headers, timeout=1.5
        )
    keys = Keys(stack.settings.key_prefix, stack.settings.partitions)
    bound = stack.store().get(keys.idempotency(principal("default", None), key))
    assert bound is not None
    parked(stack, bound.decode().split()[0])  # (the request the key names)
    with httpx.Client(base_url=stack.api_urls[1], timeout=60) as client:
        again = client.post("/v1/chat/completions", json=body, headers=headers)
        rid = again.headers["x-request-id"]
    assert again.status_code == 200 and again.headers["idempotent-replayed"] == "true"
    assert again.json()["choices"][0]["message"]["content"] == LONG
    assert int(meta(stack, rid).get(Meta.PARKS, 0)) == 1


def test_nobody_back_within_the_window_is_abandoned_with_its_waste_counted(stack: Stack) -> None:
    payload = chat_body(stack.model, LONG, stream=True, stream_options={"resume_grace_s": 3})
    rid, seen, _ = read_some(stack.api_urls[0], payload, 5)
    parked(stack, rid)
    status = wait_state(stack.api_urls[1], rid, {"abandoned", "finished"})
    assert status["state"] == "abandoned" and status["finish_reason"] == "abandoned"
    row = ledger_row(stack.settings.database_url or "", rid)
    assert row is not None and row["state"] == "abandoned"
    m = meta(stack, rid)
    with httpx.Client(base_url=stack.api_urls[0], timeout=30) as client:
        _, late = read_all(client, "GET", f"/v1/requests/{rid}/events")
    assert finish_reason(late) == "abandoned"  # a late reader gets the log and the end
    # billed: what the log carries and what the parked run threw away; wasted: all of it
    # that no reader got (what it got: the most any reader's connection was sent)
    delivered = int(m[Meta.DELIVERED])
    assert len(content_of(seen)) <= len(LONG) and delivered > 0
    logged = row["completion_tokens"] - int(m.get(Meta.DISCARDED, 0))
    assert row["wasted_tokens"] == row["completion_tokens"] - min(delivered, logged)
    assert row["completion_tokens"] < 300  # it stopped: far less than the whole answer


def test_a_parked_request_is_cancelled_at_once(stack: Stack) -> None:
    rid, _, _ = read_some(stack.api_urls[0], chat_body(stack.model, LONG, stream=True), 4)
    parked(stack, rid)
    cancelled = httpx.post(f"{stack.api_urls[1]}/v1/requests/{rid}/cancel", timeout=30)
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
    row = ledger_row(stack.settings.database_url or "", rid)
    assert row is not None and row["state"] == "cancelled"
    with httpx.Client(base_url=stack.api_urls[0], timeout=30) as client:
        _, events = read_all(client, "GET", f"/v1/requests/{rid}/events")
    assert finish_reason(events) == "cancelled" and events[-1].data == "[DONE]"


def test_readers_back_at_once_continue_it_once(stack: Stack) -> None:
    """Three readers come back to a parked request together, on both API processes: one
    continuation (its prefill counted once), and each reader gets the whole answer."""
    rid, _, _ = read_some(stack.api_urls[0], chat_body(stack.model, LONG, stream=True), 3)
    parked(stack, rid)
    logged = sum(len(d.token_ids) for d in log_deltas(stack, rid))
    results: list[list[Any]] = []

    def back(url: str) -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            results.append(read_all(client, "GET", f"/v1/requests/{rid}/events")[1])

    readers = [threading.Thread(target=back, args=(stack.api_urls[i % 2],)) for i in range(3)]
    for t in readers:
        t.start()
    for t in readers:
        t.join(timeout=60)
    assert len(results) == 3
    for events in results:
        assert content_of(events) == LONG and finish_reason(events) == "stop"
        assert_ids_increase(events)
    row = ledger_row(stack.settings.database_url or "", rid)
    assert row is not None and row["state"] == "finished"
    assert row["reprefill_tokens"] == row["prompt_tokens"] + logged  # one continuation
    assert int(meta(stack, rid)[Meta.PARKS]) == 1


@pytest.mark.parametrize("away_s", [0.3, 0.45, 0.55, 0.7])
def test_a_reconnect_racing_the_park_loses_and_repeats_nothing(stack: Stack, away_s: float) -> None:
    """Back just before, at, or just after the park delay: parked or not, continued at
    most once, the whole text, event ids increasing."""
    rid, seen, _ = read_some(stack.api_urls[0], chat_body(stack.model, LONG, stream=True), 5)
    time.sleep(away_s)
    with httpx.Client(base_url=stack.api_urls[1], timeout=60) as client:
        _, rest = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": seen[-1].id}
        )
    assert content_of(seen + rest) == LONG
    assert_ids_increase(seen + rest)
    assert finish_reason(rest) == "stop"
    assert int(meta(stack, rid).get(Meta.PARKS, 0)) <= 1


def choice_texts(events: list[Any]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for e in events:
        if e.data and e.data != "[DONE]":
            for choice in json.loads(e.data).get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or ""
                texts[choice["index"]] = texts.get(choice["index"], "") + piece
    return texts


def test_every_choice_of_n_goes_on(stack: Stack) -> None:
    payload = chat_body(stack.model, LONG, stream=True, n=2)
    rid, seen, _ = read_some(stack.api_urls[0], payload, 7)
    parked(stack, rid)
    with httpx.Client(base_url=stack.api_urls[1], timeout=60) as client:
        _, rest = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": seen[-1].id}
        )
    assert choice_texts(seen + rest) == {0: LONG, 1: LONG}
    assert_ids_increase(seen + rest)


@pytest.fixture(scope="module")
def limited(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    """One request in flight per key (auth is off: every request is one key's)."""
    with running(
        tmp_path_factory.mktemp("park-limited"),
        redis_url,
        database_url,
        model_dir,
        scripted_tokens_per_s=RATE,
        park_after_s=PARK_AFTER_S,
        presence_check_s=0.2,
        max_concurrent_per_key=1,
    ) as st:
        yield st


def test_a_parked_request_holds_no_slot_but_counts_again_when_it_goes_on(
    limited: Stack,
) -> None:
    url = limited.url
    rid, seen, _ = read_some(url, chat_body(limited.model, LONG, stream=True), 3)
    status = wait_state(url, rid, {"parked", "finished"})
    assert status["state"] == "parked"
    hi = chat_body(limited.model, "hi")
    other = httpx.post(f"{url}/v1/chat/completions", json=hi, timeout=60)
    assert other.status_code == 200  # the parked request held no slot of its key's
    rest = []
    with (
        httpx.Client(base_url=url, timeout=60) as client,
        client.stream(
            "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": seen[-1].id}
        ) as r,
    ):
        for event in EventSource(r).iter_sse():
            if not rest:  # it goes on: in flight again, so the key is at its limit
                third = httpx.post(f"{url}/v1/chat/completions", json=hi, timeout=60)
                assert third.status_code == 429, third.text
            rest.append(event)
    assert content_of(seen + rest) == LONG
