"""In-band errors from a failing or stalled engine; readers that vanish leave nothing behind."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from httpx_sse import EventSource

from service.stream.ids import Cursor
from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import LONG, chat_body, content_of, finish_reason, ledger_row, read_all
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def faulty(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    """One worker whose engine fails after 5 tokens."""
    with running(
        tmp_path_factory.mktemp("faulty"), redis_url, database_url, model_dir, scripted_fail_after=5
    ) as st:
        yield st


@pytest.fixture(scope="module")
def crashing(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    """One worker whose engine raises something that is not an engine error (a bug)."""
    with running(
        tmp_path_factory.mktemp("crashing"),
        redis_url,
        database_url,
        model_dir,
        scripted_crash_after=3,
    ) as st:
        yield st


@pytest.fixture(scope="module")
def stalled(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    """One worker whose engine stops producing after 3 tokens; deadline 2 s."""
    with running(
        tmp_path_factory.mktemp("stalled"),
        redis_url,
        database_url,
        model_dir,
        scripted_stall_after=3,
        request_deadline_s=2.0,
    ) as st:
        yield st


def _error_event(events: list) -> dict:  # type: ignore[type-arg]
    errors = [json.loads(e.data)["error"] for e in events if e.data and '"error"' in e.data[:10]]
    assert len(errors) == 1, [e.data for e in events]
    return errors[0]


def test_engine_failure_is_an_in_band_error(faulty: Stack) -> None:
    with httpx.Client(base_url=faulty.url, timeout=30) as client:
        headers, events = read_all(
            client, "POST", "/v1/chat/completions", json=chat_body(faulty.model, LONG, stream=True)
        )
        err = _error_event(events)
        assert err["code"] == "engine_failure"
        assert finish_reason(events) is None
        assert events[-1].data != "[DONE]"
        assert LONG.startswith(content_of(events))
        rid = headers["x-request-id"]
        status = client.get(f"/v1/requests/{rid}").json()
        assert status["state"] == "errored"
        # non-streaming: an error status with the same error object
        resp = client.post("/v1/chat/completions", json=chat_body(faulty.model, LONG))
        assert resp.status_code == 500
        assert resp.json()["error"]["code"] == "engine_failure"
    row = ledger_row(faulty.settings.database_url or "", rid)
    assert row is not None and row["state"] == "errored" and row["error_code"] == "engine_failure"
    assert row["completion_tokens"] == 5


def test_a_reconnect_after_the_in_band_error_is_told_to_stop(faulty: Stack) -> None:
    """An errored stream's last id is its in-band error's: an EventSource that reconnects
    with it gets 204 (stop), not an empty 200 after which it would reconnect for ever; a
    reconnect from before the error still gets the error."""
    with httpx.Client(base_url=faulty.url, timeout=30) as client:
        headers, events = read_all(
            client, "POST", "/v1/chat/completions", json=chat_body(faulty.model, LONG, stream=True)
        )
        rid = headers["x-request-id"]
        assert _error_event(events[-1:])["code"] == "engine_failure"
        done = client.get(f"/v1/requests/{rid}/events", headers={"Last-Event-ID": events[-1].id})
        assert done.status_code == 204 and done.content == b""
        _, rest = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": events[-2].id}
        )
        assert [(e.id, e.data) for e in rest] == [(e.id, e.data) for e in events[-1:]]


def test_a_bug_in_the_worker_ends_the_request_errored(crashing: Stack) -> None:
    """Not an engine error, not a dead worker: the worker itself fails mid-request. The
    reader gets an in-band internal_error and the request a terminal state and a billing
    row, instead of a stream that waits until its safety TTL."""
    with httpx.Client(base_url=crashing.url, timeout=30) as client:
        headers, events = read_all(
            client,
            "POST",
            "/v1/chat/completions",
            json=chat_body(crashing.model, LONG, stream=True),
        )
        err = _error_event(events)
        assert err["code"] == "internal_error"
        assert events[-1].data != "[DONE]"
        assert LONG.startswith(content_of(events))
        rid = headers["x-request-id"]
        assert client.get(f"/v1/requests/{rid}").json()["state"] == "errored"
    row = ledger_row(crashing.settings.database_url or "", rid)
    assert row is not None and row["state"] == "errored" and row["error_code"] == "internal_error"
    assert row["completion_tokens"] == 3


def test_stalled_engine_hits_the_deadline(stalled: Stack) -> None:
    with httpx.Client(base_url=stalled.url, timeout=60) as client:
        submitted_at = time.time()
        headers, events = read_all(
            client, "POST", "/v1/chat/completions", json=chat_body(stalled.model, LONG, stream=True)
        )
    assert _error_event(events)["code"] == "deadline_exceeded"
    # the engine stalled for good: the deadline ended it, and not before it ran out
    [error_id] = [e.id for e in events if e.data and '"error"' in e.data[:10]]
    assert Cursor.parse(error_id).event.ms / 1000 >= submitted_at + 2.0 - 0.01
    row = ledger_row(stalled.settings.database_url or "", headers["x-request-id"])
    assert row is not None and row["state"] == "errored" and row["error_code"] == "deadline"


def _readers(url: str) -> float:
    text = httpx.get(url + "/metrics").text
    match = re.search(r"^lastevent_readers (\S+)$", text, re.M)
    assert match, text
    return float(match.group(1))


def test_a_reader_that_vanishes_is_unsubscribed(stalled: Stack) -> None:
    """Disconnect mid-stream: the API process stops following the log for that client."""
    assert _readers(stalled.url) == 0
    with (
        httpx.Client(base_url=stalled.url, timeout=30) as client,
        client.stream(
            "POST", "/v1/chat/completions", json=chat_body(stalled.model, LONG, stream=True)
        ) as r,
    ):
        for _event in EventSource(r).iter_sse():
            assert _readers(stalled.url) == 1
            break
    wait_until(lambda: _readers(stalled.url) == 0, "the reader to be unsubscribed")


def test_a_worker_killed_mid_answer_with_no_other_ends_the_stream_with_an_error(
    tmp_path: Path, redis_url: str, database_url: str, model_dir: Path
) -> None:
    """kill -9 the only worker: the sweeper notices its stale heartbeat and queues the
    request for a takeover; no worker takes it within ``takeover_wait_s``, so the stream
    gets an in-band worker_lost error, the request ends errored and is billed for what was
    made (the takeover it waited for counted). Takeovers that happen: test_takeover.py."""
    import signal

    from tests.e2e.conftest import make_stack

    st = make_stack(
        tmp_path,
        redis_url,
        database_url,
        model_dir,
        scripted_tokens_per_s=20.0,
        worker_stale_s=2.0,
        takeover_wait_s=2.0,
    )
    try:
        worker = st.start_worker()
        st.start_api()
        events = []
        with (
            httpx.Client(base_url=st.url, timeout=30) as client,
            client.stream(
                "POST", "/v1/chat/completions", json=chat_body(st.model, LONG, stream=True)
            ) as r,
        ):
            rid = r.headers["x-request-id"]
            for event in EventSource(r).iter_sse():
                events.append(event)
                if len(events) == 5:
                    killed_at = time.monotonic()
                    worker.send_signal(signal.SIGKILL)
        # the stream ended (the with block is left) with the sweeper's in-band error
        took = time.monotonic() - killed_at
        print(
            f"\nworker killed: stream ended with worker_lost after {took * 1000:.0f} ms "
            f"(heartbeat stale after 2000 ms, sweep every 2000 ms, takeover wait 2000 ms)"
        )
        assert _error_event(events)["code"] == "worker_lost"
        assert events[-1].data != "[DONE]" and LONG.startswith(content_of(events))
        status = httpx.get(f"{st.url}/v1/requests/{rid}").json()
        assert status["state"] == "errored"
        # the only recorder died with the worker; a new one bills what the outbox holds
        st._spawn("recorder", "recorder", worker_id="recorder-after")
        row = ledger_row(database_url, rid)
        assert row is not None and row["state"] == "errored"
        assert row["error_code"] == "worker_lost" and row["completion_tokens"] >= 4
        assert row["takeovers"] == 1
    finally:
        st.stop()
