"""Decided before the first byte: 429 for a key over its limits, 503 when the service is
over capacity -- each with Retry-After and an error body a client can act on."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Stack, make_stack, running
from tests.e2e.helpers import chat_body
from tests.waiting import wait_until

SCRIPT = " ".join(["word"] * 40)  # every answer: 40 tokens


def check_error(resp: httpx.Response, status: int, code: str) -> int:
    assert resp.status_code == status, resp.text
    body = resp.json()["error"]
    assert body["code"] == code and body["message"]
    retry_after = int(resp.headers["retry-after"])
    assert retry_after >= 1
    return retry_after


def test_no_worker_is_503(
    tmp_path: Path, redis_url: str, database_url: str, model_dir: Path
) -> None:
    st = make_stack(tmp_path, redis_url, database_url, model_dir)
    try:
        st.start_api()  # and no worker at all
        resp = httpx.post(
            st.url + "/v1/chat/completions", json=chat_body(st.model, "hi"), timeout=30
        )
        check_error(resp, 503, "no_worker")
    finally:
        st.stop()


@pytest.fixture(scope="module")
def limited(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("limited"),
        redis_url,
        database_url,
        model_dir,
        max_concurrent_per_key=2,
        rate_limit_rpm=6,
        scripted_text=SCRIPT,
        scripted_tokens_per_s=40.0,
    ) as st:
        yield st


def test_concurrent_requests_per_key_is_429(limited: Stack) -> None:
    body = chat_body(limited.model, "x", stream=True)
    with httpx.Client(base_url=limited.url, timeout=30) as c:
        with (
            c.stream("POST", "/v1/chat/completions", json=body) as first,
            c.stream("POST", "/v1/chat/completions", json=body) as second,
        ):
            assert first.status_code == second.status_code == 200
            third = c.post("/v1/chat/completions", json=body)
            check_error(third, 429, "too_many_concurrent_requests")
            for _ in first.iter_bytes():  # the first one finishes: its slot is free again
                pass
        later = c.post("/v1/chat/completions", json=chat_body(limited.model, "x"))
        assert later.status_code == 200


def test_requests_per_minute_is_429(limited: Stack) -> None:
    with httpx.Client(base_url=limited.url, timeout=30) as c:
        statuses = []
        for _ in range(8):
            resp = c.post("/v1/chat/completions", json=chat_body(limited.model, "x", max_tokens=1))
            statuses.append(resp.status_code)
            if resp.status_code == 429:
                retry_after = check_error(resp, 429, "rate_limit_exceeded")
                assert retry_after <= 60
                break
    # this module's earlier requests count too: at most 6 in one wall-clock minute
    assert statuses[-1] == 429 and statuses.count(200) <= 6


def test_queue_that_would_wait_too_long_is_503(
    tmp_path: Path, redis_url: str, database_url: str, model_dir: Path
) -> None:
    with (
        running(
            tmp_path,
            redis_url,
            database_url,
            model_dir,
            worker_concurrency=1,
            scripted_text=SCRIPT,
            scripted_tokens_per_s=40.0,
            max_queue_wait_s=1.0,
        ) as st,
        httpx.Client(base_url=st.url, timeout=30) as c,
    ):
        # one request end to end: the worker now knows a request takes ~1 s
        assert c.post("/v1/chat/completions", json=chat_body(st.model, "x")).status_code == 200
        detached = chat_body(st.model, "x", stream=True, stream_options={"detached": True})
        for _ in range(4):  # one runs, three wait: ~3 s of queue for one slot
            with c.stream("POST", "/v1/chat/completions", json=detached) as r:
                assert r.status_code == 200
        deadline = time.monotonic() + 5  # heartbeats are once a second
        while True:  # only the status line matters: hang up right after it
            with c.stream("POST", "/v1/chat/completions", json=detached) as resp:
                resp.read() if resp.status_code != 200 else None
            if resp.status_code == 503 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        retry_after = check_error(resp, 503, "overloaded")
        assert "waiting for 1 worker slots" in resp.json()["error"]["message"]
        assert retry_after >= 1


def test_a_slot_is_freed_by_the_end_whoever_reads_it(
    tmp_path: Path, redis_url: str, database_url: str, model_dir: Path
) -> None:
    """With one slot per key: requests that end with nobody reading their end (walked
    away and abandoned, detached, cancelled while queued) give their slot back."""
    with (
        running(
            tmp_path,
            redis_url,
            database_url,
            model_dir,
            max_concurrent_per_key=1,
            scripted_tokens_per_s=200.0,
        ) as st,
        httpx.Client(base_url=st.url, timeout=30) as c,
    ):
        for _ in range(3):  # walk away at once: abandoned after a zero grace
            # an answer long enough to be abandoned, not finished, however loaded the machine
            body = chat_body(
                st.model,
                "bye " * 150,
                stream=True,
                stream_options={"resume_grace_s": 0},
                max_tokens=200,
            )
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                rid = r.headers["x-request-id"]
            # nobody reads its end: the next request (this loop's) must still be admitted
            wait_until(
                lambda rid=rid: c.get(f"/v1/requests/{rid}").json()["state"] == "abandoned",
                what="the abandoned end",
                timeout=30,
            )
        body = chat_body(st.model, "alone", stream_options={"detached": True}, stream=True)
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            rid = r.headers["x-request-id"]  # and leave at once: it runs to its end alone
        wait_until(
            lambda: c.get(f"/v1/requests/{rid}").json()["state"] == "finished",
            what="the detached end",
            timeout=30,
        )
        later = c.post("/v1/chat/completions", json=chat_body(st.model, "x"))
        assert later.status_code == 200, later.text
