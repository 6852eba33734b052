"""Cancellation as a capacity feature: disconnect, reconnect, abandon, cancel -- for real.

Two API processes and one worker (scripted engine at 40 tokens/s with a 0.8 s
prefill); leases refresh every 0.5 s and lapse after 2 s; the worker checks its
requests every 0.2 s. Latencies are printed (run with -s to see them), never asserted:
a test asserts what happened (the state, the tokens, the rows) and, where the code
guarantees one, a lower bound (nothing is abandoned before its grace period). The
cancels during the prefill run on a stack whose prefill takes ten minutes, so that they
land in it however slow the machine is.
"""

from __future__ import annotations

import datetime as dt
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource

from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import (
    LONG,
    chat_body,
    content_of,
    finish_reason,
    ledger_row,
    read_all,
    read_some,
    wait_state,
)
from tests.waiting import wait_until

RATE = 40.0
LONG_PREFILL_S = 600.0  # longer than any test: only an abort ends it
# a reader-less request is parked after this long (tests/e2e/test_park.py): longer than any
# answer here, so that these tests see a request run on (or end) while its reader is away
PARK_AFTER_S = 60.0


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("cancel"),
        redis_url,
        database_url,
        model_dir,
        apis=2,
        scripted_tokens_per_s=RATE,
        scripted_prefill_s=0.8,
        worker_concurrency=3,
        presence_check_s=0.2,
        lease_refresh_s=0.5,
        lease_ttl_s=2.0,
        cancel_wait_s=5.0,
        park_after_s=PARK_AFTER_S,
    ) as st:
        yield st


@pytest.fixture(scope="module")
def prefill_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    """As ``stack``, but a prefill outlasts every test: a request is in it until aborted."""
    with running(
        tmp_path_factory.mktemp("prefill"),
        redis_url,
        database_url,
        model_dir,
        apis=2,
        scripted_tokens_per_s=RATE,
        scripted_prefill_s=LONG_PREFILL_S,
        worker_concurrency=3,
        presence_check_s=0.2,
        lease_refresh_s=0.5,
        lease_ttl_s=2.0,
        cancel_wait_s=5.0,
        park_after_s=PARK_AFTER_S,
    ) as st:
        yield st


def body(stack: Stack, **options: Any) -> dict[str, Any]:
    return chat_body(stack.model, LONG, stream=True, stream_options=options)


def end_time(status: dict[str, Any]) -> float:
    """When the request's terminal event was written (its id's milliseconds), in seconds."""
    return int(status["last_event_id"].split("-")[0]) / 1000


def test_reconnect_within_grace_completes(stack: Stack) -> None:
    # a grace period far longer than the absence: the reconnect is within it on any machine
    rid, seen, _ = read_some(stack.api_urls[0], body(stack, resume_grace_s=60), 8)
    time.sleep(1.0)  # the phone went through a tunnel (no reader for a while, not a sync)
    with httpx.Client(base_url=stack.api_urls[1], timeout=30) as client:
        _, rest = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": seen[-1].id}
        )
    assert content_of(seen + rest) == LONG
    assert finish_reason(rest) == "stop"
    row = ledger_row(stack.settings.database_url or "", rid)
    assert row is not None and row["state"] == "finished" and row["wasted_tokens"] == 0


def test_a_client_away_at_the_end_that_reads_it_all_later_wasted_nothing(stack: Stack) -> None:
    """The answer ended while the client was between connections; it came back and read
    every token: billed 0 wasted (the row is written at the end, before it came back)."""
    rid, seen, _ = read_some(stack.api_urls[0], body(stack, resume_grace_s=60), 4)
    with httpx.Client(base_url=stack.api_urls[1], timeout=30) as client:
        wait_until(
            lambda: client.get(f"/v1/requests/{rid}").json()["state"] == "finished",
            what="the end, while nobody reads",
            timeout=60,
        )
        row = ledger_row(stack.settings.database_url or "", rid)
        _, rest = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": seen[-1].id}
        )
    assert content_of(seen + rest) == LONG
    assert row is not None and row["state"] == "finished" and row["wasted_tokens"] == 0


def test_disconnect_and_stay_away_is_abandoned(stack: Stack) -> None:
    grace_s = 1.0
    rid, seen, leaving_at = read_some(stack.api_urls[0], body(stack, resume_grace_s=grace_s), 6)
    status = wait_state(stack.api_urls[1], rid, {"abandoned", "finished"})
    assert status["state"] == "abandoned"
    assert status["finish_reason"] == "abandoned"
    latency = end_time(status) - leaving_at
    print(
        f"\nabandon: last reader left -> terminal event {latency * 1000:.0f} ms "
        f"(grace {grace_s * 1000:.0f} ms, check every 200 ms, 1 step = {1000 / RATE:.0f} ms)"
    )
    # never before the grace ran out (the reader left after leaving_at; the ids' ms floor)
    assert latency >= grace_s - 0.002
    row = ledger_row(stack.settings.database_url or "", rid)
    assert row is not None and row["state"] == "abandoned"
    shown = len(content_of(seen))
    assert 0 < row["completion_tokens"] < len(LONG)
    # what the reader never got was counted as waste; what it got was not
    assert 0 < row["wasted_tokens"] < row["completion_tokens"]
    assert row["completion_tokens"] - row["wasted_tokens"] <= shown + 5
    # a late reader still gets the log and the end
    with httpx.Client(base_url=stack.api_urls[1], timeout=30) as client:
        _, late = read_all(client, "GET", f"/v1/requests/{rid}/events")
    assert finish_reason(late) == "abandoned" and late[-1].data == "[DONE]"


def test_two_readers_one_leaves(stack: Stack) -> None:
    """Even with a zero grace period, a request with a reader left is not aborted."""
    payload = body(stack, resume_grace_s=0)
    result: dict[str, Any] = {}
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", stack.api_urls[0] + "/v1/chat/completions", json=payload) as first,
    ):
        rid = first.headers["x-request-id"]

        def second() -> None:
            with httpx.Client(base_url=stack.api_urls[1], timeout=30) as c:
                result["events"] = read_all(c, "GET", f"/v1/requests/{rid}/events")[1]

        reader = threading.Thread(target=second)
        reader.start()
        for i, _event in enumerate(EventSource(first).iter_sse()):
            if i == 5:
                break  # the first reader leaves; the second stays
    reader.join(timeout=30)
    assert content_of(result["events"]) == LONG
    assert finish_reason(result["events"]) == "stop"


def test_cancel_mid_decode_from_another_api(stack: Stack) -> None:
    payload = body(stack, include_usage=True)
    events = []
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", stack.api_urls[0] + "/v1/chat/completions", json=payload) as r,
    ):
        rid = r.headers["x-request-id"]
        stream = EventSource(r).iter_sse()
        for event in stream:
            events.append(event)
            if len(events) == 10:
                break
        sent = time.monotonic()
        resp = httpx.post(f"{stack.api_urls[1]}/v1/requests/{rid}/cancel", timeout=30)
        took = time.monotonic() - sent
        events.extend(stream)  # the stream goes on to its end on the first API
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "cancelled"
    print(f"\ncancel mid-decode: request -> terminal state {took * 1000:.0f} ms")
    assert finish_reason(events) == "cancelled"
    assert events[-1].data == "[DONE]"
    assert json.loads(events[-2].data)["usage"]["completion_tokens"] > 0
    assert LONG.startswith(content_of(events)) and len(content_of(events)) < len(LONG)
    row = ledger_row(stack.settings.database_url or "", rid)
    assert row is not None and row["state"] == "cancelled"
    # the engine stopped within a step or two of the cancel: few tokens nobody saw
    assert row["wasted_tokens"] <= 3
    again = httpx.post(f"{stack.api_urls[0]}/v1/requests/{rid}/cancel")
    assert again.status_code == 200 and again.json() == resp.json()  # idempotent


def test_cancel_during_prefill(prefill_stack: Stack) -> None:
    stack = prefill_stack
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", stack.api_urls[0] + "/v1/chat/completions", json=body(stack)) as r,
    ):
        rid = r.headers["x-request-id"]
        wait_state(stack.api_urls[0], rid, {"running"})
        resp = httpx.post(f"{stack.api_urls[1]}/v1/requests/{rid}/cancel", timeout=30)
        events = list(EventSource(r).iter_sse())  # ends: the cancel cut the prefill short
    assert resp.json()["state"] == "cancelled"
    assert resp.json()["usage"]["completion_tokens"] == 0  # the prefill never produced one
    assert content_of(events) == ""
    assert finish_reason(events) == "cancelled"


def test_cancel_while_queued_never_reaches_the_engine(stack: Stack) -> None:
    # fill the worker's three slots with detached requests, so a fourth stays queued
    blockers = [start_detached(stack) for _ in range(3)]
    for rid in blockers:
        wait_state(stack.url, rid, {"running"})
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", stack.api_urls[0] + "/v1/chat/completions", json=body(stack)) as r,
    ):
        rid = r.headers["x-request-id"]
        assert httpx.get(f"{stack.url}/v1/requests/{rid}").json()["state"] == "queued"
        resp = httpx.post(f"{stack.api_urls[1]}/v1/requests/{rid}/cancel", timeout=30)
        events = list(EventSource(r).iter_sse())
    assert resp.status_code == 200 and resp.json()["state"] == "cancelled"
    assert finish_reason(events) == "cancelled" and events[-1].data == "[DONE]"
    row = ledger_row(stack.settings.database_url or "", rid)
    assert row is not None and row["completion_tokens"] == 0 and row["worker_id"] is None
    for other in blockers:  # detached requests run on with no reader; cancel them
        assert (
            httpx.post(f"{stack.url}/v1/requests/{other}/cancel", timeout=30).json()["state"]
            == "cancelled"
        )


def start_detached(stack: Stack) -> str:
    """Submit a detached request and hang up at once: it runs on with no reader."""
    with (
        httpx.Client(timeout=30) as client,
        client.stream(
            "POST", stack.url + "/v1/chat/completions", json=body(stack, detached=True)
        ) as r,
    ):
        return r.headers["x-request-id"]


def test_detached_request_runs_to_completion_with_no_reader(stack: Stack) -> None:
    rid = start_detached(stack)
    status = wait_state(stack.url, rid, {"finished", "abandoned"}, timeout_s=30)
    assert status["state"] == "finished"
    row = ledger_row(stack.settings.database_url or "", rid)
    # a finished answer is in the log for a later reader (a background job): not wasted
    assert row is not None and row["wasted_tokens"] == 0 < row["completion_tokens"]


def test_cancel_after_finish_and_unknown(stack: Stack) -> None:
    done = httpx.post(
        stack.url + "/v1/chat/completions", timeout=30, json=chat_body(stack.model, "short")
    )
    rid = done.json()["id"]
    resp = httpx.post(f"{stack.url}/v1/requests/{rid}/cancel")
    assert resp.status_code == 200
    assert resp.json()["state"] == "finished" and resp.json()["finish_reason"] == "stop"
    missing = httpx.post(f"{stack.url}/v1/requests/chatcmpl-nope/cancel")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "not_found"


def test_non_streaming_client_that_times_out_is_abandoned(stack: Stack) -> None:
    payload = chat_body(stack.model, LONG, stream_options={"resume_grace_s": 1})
    since = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=0.01)  # the ledger's ms floor
    with pytest.raises(httpx.ReadTimeout), httpx.Client(timeout=1.5) as client:
        client.post(stack.url + "/v1/chat/completions", json=payload)
    # find it through the ledger once it ends: the newest abandoned request since then
    # (this session's database; this module's earlier requests were created before)
    row = wait_until(lambda: _latest_row(stack, "abandoned", since), "an abandoned row", timeout=60)
    assert row["wasted_tokens"] == row["completion_tokens"] > 0  # nobody got any of it


def _latest_row(stack: Stack, state: str, since: dt.datetime) -> dict[str, Any] | None:
    import asyncio

    from sqlalchemy import text
    from sqlalchemy.ext.asyncio import create_async_engine

    async def fetch() -> dict[str, Any] | None:
        engine = create_async_engine(stack.settings.database_url or "")
        try:
            async with engine.connect() as conn:
                row = (
                    (
                        await conn.execute(
                            text(
                                "SELECT * FROM requests WHERE state = :s AND created_at >= :since "
                                "ORDER BY ended_at DESC LIMIT 1"
                            ),
                            {"s": state, "since": since},
                        )
                    )
                    .mappings()
                    .first()
                )
            return dict(row) if row else None
        finally:
            await engine.dispose()

    return asyncio.run(fetch())


@pytest.fixture(scope="module")
def burst_stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("burst"),
        redis_url,
        database_url,
        model_dir,
        scripted_tokens_per_s=RATE,
        worker_concurrency=32,
        presence_check_s=0.2,
        lease_refresh_s=0.5,
        lease_ttl_s=2.0,
        # what a reader was sent counts as delivered: at ``replica`` (the cluster tier's)
        # a reader is behind the engine by its confirmations, which under load grew the
        # waste past the grace's bound (87 and 92 of 86-90); this test is the grace's
        durability="memory",
    ) as st:
        yield st


async def test_burst_with_walkaways_wastes_at_most_what_the_grace_allows(
    burst_stack: Stack,
) -> None:
    """20 concurrent streams, 2 of them (10%) walk away mid-answer and never return."""
    import asyncio

    from httpx_sse import aconnect_sse

    grace_s, clients, leavers = 1.0, 20, 2
    payload = body(burst_stack, resume_grace_s=grace_s)

    async def client_run(i: int, http: httpx.AsyncClient) -> tuple[str, bool]:
        async with aconnect_sse(http, "POST", "/v1/chat/completions", json=payload) as source:
            rid = source.response.headers["x-request-id"]
            n = 0
            async for _event in source.aiter_sse():
                n += 1
                if i < leavers and n == 8:
                    return rid, True  # walks away
        return rid, False

    async with httpx.AsyncClient(base_url=burst_stack.url, timeout=60) as http:
        runs = await asyncio.gather(*(client_run(i, http) for i in range(clients)))
    url = burst_stack.settings.database_url or ""
    rows = [await asyncio.to_thread(ledger_row, url, rid) for rid, _ in runs]
    assert all(r is not None for r in rows)
    wasted = sum(r["wasted_tokens"] for r in rows if r)  # type: ignore[index]
    left = [r for (_, gone), r in zip(runs, rows, strict=True) if gone]
    stayed = [r for (_, gone), r in zip(runs, rows, strict=True) if not gone]
    assert all(r["state"] == "abandoned" for r in left)  # type: ignore[index]
    assert all(r["state"] == "finished" and r["wasted_tokens"] == 0 for r in stayed)  # type: ignore[index]
    # the grace period at the decode rate, plus the steps the engine makes while the
    # abort reaches it (the step in flight and the next), per abandoned request
    bound = leavers * (grace_s * RATE + 3)
    generated = sum(r["completion_tokens"] for r in rows if r)  # type: ignore[index]
    print(
        f"\nburst: {clients} clients, {leavers} walked away; wasted {wasted} of {generated} "
        f"generated tokens (bound {bound:.0f} = {leavers} x ({grace_s:g} s grace x {RATE:g} "
        f"tok/s + 3 steps))"
    )
    assert 0 < wasted <= bound


def test_disconnect_is_noticed_without_any_write(prefill_stack: Stack) -> None:
    """Gone during the prefill (nothing written since the role chunk), zero grace:
    aborted at once, not when the next token would have been written."""
    stack = prefill_stack
    rid, _, leaving_at = read_some(stack.api_urls[0], body(stack, resume_grace_s=0), 1)
    status = wait_state(stack.api_urls[0], rid, {"abandoned", "finished"})
    took_ms = (end_time(status) - leaving_at) * 1000
    print(f"\ndisconnect during prefill, grace 0: terminal after {took_ms:.0f} ms")
    assert status["state"] == "abandoned"
    # the prefill (10 minutes) never finished: the next write would have been a token
    assert status["usage"]["completion_tokens"] == 0
