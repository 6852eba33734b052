"""``lastevent node``: the API and a worker in one process, its own readers fed from its
worker's appends in memory (``store/local.py``), everyone else reading the log in Redis
as in the split deployment.

Real processes: nodes (``python -m service.cli node``) and an API replica on real Redis
and Postgres, the scripted engine at 40 tokens/s (it echoes the prompt, so the whole
answer is known and a continuation must give exactly it). A node killed with kill -9
stays dead. Each test asserts the bytes, the states and the billing rows, and that the
node's readers were fed from memory (its ``lastevent_node_events_from_memory``) -- the
timeouts are safety nets only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource, ServerSentEvent

from service.stream.lifecycle import Meta
from tests.e2e.conftest import Stack, make_stack
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
from tests.e2e.test_park import meta
from tests.e2e.test_takeover import (
    logged_text,
    now,
    owner_of,
    reconcile_clean,
    takeover_db,  # noqa: F401 - a fixture: a database of this module's own
)
from tests.waiting import wait_until

SAFETY_S = 120.0
SETTINGS: dict[str, object] = {
    "scripted_tokens_per_s": 40.0,
    "scripted_prefill_s": 0.2,
    "park_after_s": 0.5,
    "presence_check_s": 0.2,
    "lease_refresh_s": 0.5,
    "lease_ttl_s": 2.0,
    "sweep_interval_s": 0.5,
    "worker_stale_s": 2.0,
    "recorder_claim_idle_ms": 1000,  # a killed node's recorder entries are taken soon
}


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    takeover_db: str,  # noqa: F811
    model_dir: Path,
) -> Iterator[Stack]:
    """A node (``api_urls[0]``) and an API replica (``api_urls[1]``)."""
    st = make_stack(tmp_path_factory.mktemp("node"), redis_url, takeover_db, model_dir, **SETTINGS)
    try:
        st.start_node("node")
        st.start_api()
        yield st
    finally:
        st.stop()


def from_memory(url: str) -> float:
    """Events the node at ``url`` has handed its readers from memory so far."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    found = re.search(r"^lastevent_node_events_from_memory ([0-9.e+]+)$", text, re.M)
    assert found is not None, "no lastevent_node_events_from_memory in the node's /metrics"
    return float(found.group(1))


def frames(events: list[ServerSentEvent]) -> list[tuple[str, str]]:
    return [(e.id, e.data) for e in events]


def assert_whole(events: list[ServerSentEvent]) -> None:
    assert content_of(events) == LONG  # the greedy text, whole: no gap, no repeat
    assert "\ufffd" not in content_of(events)
    assert finish_reason(events) == "stop" and events[-1].data == "[DONE]"
    assert_ids_increase(events)


def test_a_node_s_reader_is_fed_from_memory_and_the_log_says_the_same(stack: Stack) -> None:
    """The node's reader gets its whole answer from memory; a replay of the log on the
    replica and on the node, and a resume from every tenth cursor on either, give the
    same frames, ids included."""
    node, replica = stack.api_urls
    before = from_memory(node)
    with httpx.Client(base_url=node, timeout=SAFETY_S) as client:
        headers, live = read_all(
            client,
            "POST",
            "/v1/chat/completions",
            json=chat_body(stack.model, LONG, stream=True, stream_options={"include_usage": True}),
        )
    rid = headers["x-request-id"]
    assert_whole(live)
    deltas = sum(1 for e in live if '"content":' in e.data)
    assert from_memory(node) - before >= deltas  # every delta came from memory
    for url in (replica, node):
        with httpx.Client(base_url=url, timeout=SAFETY_S) as client:
            _, replay = read_all(client, "GET", f"/v1/requests/{rid}/events")
            assert frames(replay) == frames(live)
            for cut in range(0, len(live) - 1, 10):
                _, rest = read_all(
                    client,
                    "GET",
                    f"/v1/requests/{rid}/events",
                    headers={"Last-Event-ID": live[cut].id},
                )
                assert frames(rest) == frames(live[cut + 1 :]), (url, cut)
    row = ledger_row(stack.settings.database_url or "", rid, timeout_s=60)
    assert row is not None and row["state"] == "finished" and row["takeovers"] == 0


@pytest.mark.parametrize("back_to", [0, 1], ids=["on-the-node", "on-the-replica"])
def test_a_reader_that_reconnects_mid_answer_gets_exactly_the_rest(
    stack: Stack, back_to: int
) -> None:
    """Dropped after a few events and back at once (within the park delay: the request
    runs on): the rest, read back from the cursor and then fed live, from memory on the
    node and from Redis on the replica, with neither gap nor repeat."""
    node = stack.api_urls[0]
    payload = chat_body(stack.model, LONG, stream=True)
    rid, seen, _ = read_some(node, payload, 5)
    before = from_memory(node)
    with httpx.Client(base_url=stack.api_urls[back_to], timeout=SAFETY_S) as client:
        _, rest = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": seen[-1].id}
        )
    assert_whole(seen + rest)
    assert int(meta(stack, rid).get(Meta.PARKS, 0)) == 0
    if back_to == 0:
        assert from_memory(node) > before  # what came after the read back


def test_a_parked_request_goes_on_in_the_node_when_its_reader_is_back(stack: Stack) -> None:
    """Its reader gone, the node parks the request; the reader back on the node (its
    worker claims the request again, and the reader, waiting on the log in Redis, moves
    to memory) gets the whole answer."""
    node, replica = stack.api_urls
    payload = chat_body(stack.model, LONG, stream=True, stream_options={"include_usage": True})
    rid, seen, _ = read_some(node, payload, 6)
    status = wait_state(replica, rid, {"parked", "finished"})
    assert status["state"] == "parked", status
    before = from_memory(node)
    with httpx.Client(base_url=node, timeout=SAFETY_S) as client:
        _, rest = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": seen[-1].id}
        )
    assert_whole(seen + rest)
    assert from_memory(node) > before
    row = ledger_row(stack.settings.database_url or "", rid, timeout_s=60)
    assert row is not None and row["state"] == "finished" and row["finish_reason"] == "stop"
    assert int(meta(stack, rid)[Meta.PARKS]) == 1


@dataclasses.dataclass
class Reader:
    """One SSE reader in a thread, kept going until its stream ends or its server dies."""

    url: str
    method: str
    path: str
    body: dict[str, Any] | None = None
    events: list[ServerSentEvent] = dataclasses.field(default_factory=list)
    request_id: str = ""
    started: threading.Event = dataclasses.field(default_factory=threading.Event)
    cut: BaseException | None = None

    def run(self) -> None:
        try:
            with (
                httpx.Client(base_url=self.url, timeout=SAFETY_S) as client,
                client.stream(self.method, self.path, json=self.body) as r,
            ):
                assert r.status_code == 200, r.read()
                self.request_id = r.headers["x-request-id"]
                for event in EventSource(r).iter_sse():
                    self.events.append(event)
                    if len(self.events) >= 3:
                        self.started.set()
        except httpx.HTTPError as exc:  # its node was killed
            self.cut = exc
        finally:
            self.started.set()


def test_a_node_killed_mid_answer_another_node_goes_on(
    tmp_path: Path,
    redis_url: str,
    takeover_db: str,  # noqa: F811
    model_dir: Path,
) -> None:
    """Node a runs the request, a reader on a and one on node b (b's follows the log in
    Redis: a writes it). kill -9 of a: b takes the request over, its reader moves to
    memory and gets the whole answer; a's reader, cut off, reconnects to b with its last
    id and gets exactly the rest. Billed once, with the takeover counted."""
    since = now()
    st = make_stack(tmp_path, redis_url, takeover_db, model_dir, **SETTINGS)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    try:
        a = st.start_node("a")
        on_a = Reader(
            st.api_urls[0], "POST", "/v1/chat/completions", chat_body(st.model, LONG, stream=True)
        )
        reading_a = pool.submit(on_a.run)
        assert on_a.started.wait(SAFETY_S) and on_a.request_id, "the stream never started"
        rid = on_a.request_id
        st.start_node("b")
        b_url = st.api_urls[1]
        before = from_memory(b_url)
        on_b = Reader(b_url, "GET", f"/v1/requests/{rid}/events")
        reading_b = pool.submit(on_b.run)
        wait_until(lambda: len(on_b.events) >= 3, "the reader on b to follow the log")
        assert owner_of(st, rid).startswith("a-")
        assert len(logged_text(st, rid)) < len(LONG)
        a.send_signal(signal.SIGKILL)
        a.wait()
        reading_a.result(timeout=SAFETY_S)
        reading_b.result(timeout=SAFETY_S)
        assert on_a.cut is not None and on_b.cut is None
        assert_whole(on_b.events)
        assert from_memory(b_url) > before  # b's reader was moved to memory
        with httpx.Client(base_url=b_url, timeout=SAFETY_S) as client:
            _, rest = read_all(
                client,
                "GET",
                f"/v1/requests/{rid}/events",
                headers={"Last-Event-ID": on_a.events[-1].id},
            )
        assert_whole(on_a.events + rest)
        assert owner_of(st, rid).startswith("b-")
        row = ledger_row(st.settings.database_url or "", rid, timeout_s=60)
        assert row is not None and row["state"] == "finished" and row["takeovers"] == 1, row
        reconcile_clean(st, since)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
        st.stop()
