"""The upstream engine in text mode, in front of a real OpenAI-compatible server that
streams text only: another lastevent stack (its own API and scripted worker; it frames
its stream with ``id:`` and ``retry:`` lines as well, which the engine must read past).

What holds in text mode, and what is said rather than faked: the answer is the
upstream's, its usage the upstream's count; a client resumes from the log as from any
engine; a reader who leaves does not park the request (the upstream cannot continue a
prefix) -- it runs on and completes with nobody reading; a request whose worker is
killed is not continued by the next worker but ends in band ``worker_lost``; what the
upstream could not honour (tools, logit_bias) is a 400 before the request exists.
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import Stack, make_stack, running
from tests.e2e.helpers import chat_body, content_of, read_all, read_some, wait_state
from tests.e2e.test_takeover import owner_of
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)

WORDS = " ".join(f"word{i}" for i in range(60))  # the scripted upstream echoes it


@pytest.fixture(scope="module")
def upstream(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("upstream")
    with running(tmp, redis_url, database_url, model_dir, scripted_tokens_per_s=60.0) as st:
        yield st


def front_stack(
    tmp: Path, upstream: Stack, redis_url: str, database_url: str, model_dir: Path
) -> Stack:
    return make_stack(
        tmp,
        redis_url,
        database_url,
        model_dir,
        engine="upstream",
        upstream_mode="text",
        upstream_url=upstream.url + "/v1",
        upstream_retry_s=5.0,
        park_after_s=0.3,
        resume_window_s=120.0,
    )


@pytest.fixture(scope="module")
def front(
    tmp_path_factory: pytest.TempPathFactory,
    upstream: Stack,
    redis_url: str,
    database_url: str,
    model_dir: Path,
) -> Iterator[Stack]:
    st = front_stack(tmp_path_factory.mktemp("front"), upstream, redis_url, database_url, model_dir)
    try:
        st.start_worker()
        st.start_api()
        yield st
    finally:
        st.stop()


def test_the_answer_and_its_usage_are_the_upstreams(upstream: Stack, front: Stack) -> None:
    body = chat_body(front.model, "Say these back: " + WORDS, temperature=0)
    direct = httpx.post(upstream.url + "/v1/chat/completions", json=body, timeout=120).json()
    with httpx.Client(timeout=120) as client:
        _, events = read_all(
            client,
            "POST",
            front.url + "/v1/chat/completions",
            json={**body, "stream": True, "stream_options": {"include_usage": True}},
        )
    assert content_of(events) == direct["choices"][0]["message"]["content"]
    chunks = [json.loads(e.data) for e in events if e.data.startswith("{")]
    usage = [c["usage"] for c in chunks if c.get("usage")]
    assert usage and usage[-1]["completion_tokens"] == direct["usage"]["completion_tokens"]


def test_a_reader_resumes_from_the_log(front: Stack) -> None:
    body = chat_body(front.model, WORDS, stream=True)
    rid, seen, _ = read_some(front.url, body, 5)
    last = [e.id for e in seen if e.id][-1]
    with httpx.Client(timeout=120) as client:
        _, rest = read_all(
            client,
            "GET",
            f"{front.url}/v1/requests/{rid}/events",
            headers={"Last-Event-ID": last},
        )
        _, whole = read_all(client, "GET", f"{front.url}/v1/requests/{rid}/events")
    assert content_of(seen) + content_of(rest) == content_of(whole)
    assert content_of(whole).strip() == WORDS


def test_a_gone_reader_does_not_park_it_runs_on_and_completes(front: Stack) -> None:
    rid, _, _ = read_some(front.url, chat_body(front.model, WORDS, stream=True), 3)
    # no reader comes back: with a token-mode engine it would park (past park_after_s)
    # and wait; here the upstream goes on, and the request completes unread
    status = wait_state(front.url, rid, {"finished", "parked", "errored", "abandoned"})
    assert status["state"] == "finished", status
    with httpx.Client(timeout=120) as client:
        _, whole = read_all(client, "GET", f"{front.url}/v1/requests/{rid}/events")
    assert content_of(whole).strip() == WORDS


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"top_k": 5}, "top_k"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
            "tools",
        ),
    ],
)
def test_what_text_mode_cannot_honour_is_a_400(
    front: Stack, extra: dict[str, object], param: str
) -> None:
    r = httpx.post(
        front.url + "/v1/chat/completions", json=chat_body(front.model, "hi", **extra), timeout=30
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_a_killed_worker_ends_its_request_worker_lost(
    tmp_path: Path, upstream: Stack, redis_url: str, database_url: str, model_dir: Path
) -> None:
    st = front_stack(tmp_path, upstream, redis_url, database_url, model_dir)
    try:
        first = st.start_worker("first")
        st.start_api()
        long = chat_body(st.model, f"{WORDS} {WORDS} {WORDS}", stream=True, max_tokens=1000)
        rid, seen, _ = read_some(st.url, long, 4)
        assert content_of(seen)
        wait_until(lambda: owner_of(st, rid) != "", "the request to have an owner")
        first.send_signal(signal.SIGKILL)
        first.wait()
        st.start_worker("second")  # it claims the request again, and cannot continue it
        status = wait_state(st.url, rid, {"finished", "errored"}, timeout_s=120)
        assert status["state"] == "errored", status
        with httpx.Client(timeout=120) as client:
            _, whole = read_all(client, "GET", f"{st.url}/v1/requests/{rid}/events")
        errors = [json.loads(e.data)["error"] for e in whole if '"error"' in (e.data or "")]
        assert errors and errors[-1]["code"] == "worker_lost", [e.data for e in whole[-3:]]
        # what it had sent stays: the client keeps the text it got
        assert content_of(whole).startswith(content_of(seen))
    finally:
        st.stop()
