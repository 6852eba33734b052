"""The whole stack in token mode (``LASTEVENT_ENGINE=upstream``) in front of the test
upstream, ``tests/upstream_server.py`` over the CPU engine, run as a process of its own:
the API and workers are lastevent's, the model runs behind HTTP.

Greedy decoding, so each answer is known: the upstream's own answer, asked directly. A
chat stream through the API is that answer, id for id; a worker killed (kill -9)
mid-answer is continued by the other from the log, id for id; a request whose reader
left parks (the upstream lets go of it) and continues when a reader returns; a cancel
closes the upstream's stream and the upstream's running count falls to 0.
``tests/vllm`` runs the same against the real ``vllm serve``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource

from service.settings import MODEL_NAME
from service.tokenize import ModelInfo
from tests.e2e.conftest import Stack, make_stack, running
from tests.e2e.helpers import chat_body, content_of, finish_reason, read_all, read_some, wait_state
from tests.e2e.test_cpu_takeover import STALE_S, a_kill_mid_answer_changes_nothing, logged_ids
from tests.e2e.test_takeover import (
    Stream,
    takeover_db,  # noqa: F401 - a fixture: a database of its own
)
from tests.engine_contract import chat_ids
from tests.upstream_server import ServerProcess
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(600)

QUESTION = "Write a long story about an old lighthouse keeper, his dog and the winter sea."
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def upstream(upstream_server: ServerProcess) -> ServerProcess:
    return upstream_server  # (tests/conftest.py)


def in_front_of(upstream: Any) -> dict[str, Any]:
    """A stack's settings for workers that run the upstream engine in front of
    ``upstream`` (its ``url``: this module's test server, or the vLLM tier's ``vllm serve``)."""
    return {
        "engine": "upstream",
        "upstream_url": upstream.url,
        "worker_stale_s": STALE_S,
        "recorder_claim_idle_ms": 1000,  # a killed worker's recorder entries are taken soon
    }


def upstream_stack(
    tmp: Path, upstream: Any, redis_url: str, db: str, model_dir: Path, **extra: Any
) -> Stack:
    """A stack in front of ``upstream``, none of its processes started yet."""
    return make_stack(tmp, redis_url, db, model_dir, **in_front_of(upstream), **extra)


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory,
    upstream: ServerProcess,
    redis_url: str,
    takeover_db: str,  # noqa: F811
    model_dir: Path,
) -> Iterator[Stack]:
    """One upstream worker, one API; a reader-less request parks after 0.5 s."""
    with running(
        tmp_path_factory.mktemp("stack"),
        redis_url,
        takeover_db,
        model_dir,
        **in_front_of(upstream),
        park_after_s=0.5,
        presence_check_s=0.2,
        resume_window_s=120.0,
    ) as st:
        yield st


def direct_answer(upstream: ServerProcess, model: ModelInfo, question: str) -> list[int]:
    """The upstream's own greedy ids for a one-message chat, asked directly."""
    body = {
        "model": MODEL_NAME,
        "prompt": chat_ids(model, question),
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "stream": True,
        "return_token_ids": True,
    }
    ids: list[int] = []
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", f"{upstream.url}/completions", json=body) as r,
    ):
        for event in EventSource(r).iter_sse():
            if event.data != "[DONE]":
                ids += json.loads(event.data)["choices"][0]["token_ids"]
    return ids


def greedy(**extra: Any) -> dict[str, Any]:
    return {"temperature": 0, "max_tokens": MAX_TOKENS, **extra}


def test_a_chat_stream_is_the_upstreams_greedy_answer(
    stack: Stack, upstream: ServerProcess, model: ModelInfo
) -> None:
    want = direct_answer(upstream, model, QUESTION)
    with httpx.Client(timeout=120) as client:
        headers, events = read_all(
            client,
            "POST",
            stack.url + "/v1/chat/completions",
            json=chat_body(stack.model, QUESTION, stream=True, **greedy()),
        )
    rid = headers["x-request-id"]
    assert logged_ids(stack, rid) == want
    assert content_of(events) == model.decode(want)
    assert finish_reason(events) in ("stop", "length") and events[-1].data == "[DONE]"
    wait_until(lambda: upstream.held() == 0, "the upstream to hold nothing")


def test_a_parked_request_leaves_the_upstream_and_goes_on_when_a_reader_returns(
    stack: Stack, upstream: ServerProcess, model: ModelInfo
) -> None:
    want = direct_answer(upstream, model, QUESTION)
    payload = chat_body(stack.model, QUESTION, stream=True, **greedy())
    rid, seen, _ = read_some(stack.url, payload, 4)
    status = wait_state(stack.url, rid, {"parked", "finished"})
    assert status["state"] == "parked", status
    wait_until(lambda: upstream.held() == 0, "the upstream to let go of the parked request")
    with httpx.Client(timeout=120) as client:
        _, rest = read_all(
            client,
            "GET",
            f"{stack.url}/v1/requests/{rid}/events",
            headers={"Last-Event-ID": [e.id for e in seen if e.id][-1]},
        )
    assert content_of(seen) + content_of(rest) == model.decode(want)
    assert logged_ids(stack, rid) == want  # continued from the log, id for id
    assert rest[-1].data == "[DONE]"


def test_a_cancel_closes_the_upstreams_stream(stack: Stack, upstream: ServerProcess) -> None:
    payload = chat_body(stack.model, QUESTION, stream=True, max_tokens=2000)
    with (
        httpx.Client(timeout=120) as client,
        client.stream("POST", stack.url + "/v1/chat/completions", json=payload) as r,
    ):
        rid = r.headers["x-request-id"]
        events = []
        for event in EventSource(r).iter_sse():  # (read on: the reader stays, no park)
            events.append(event)
            if len(events) == 3:
                assert upstream.gauges()["running"] == 1
                cancelled = httpx.post(f"{stack.url}/v1/requests/{rid}/cancel", timeout=30)
                assert cancelled.status_code == 200, cancelled.text
    assert finish_reason(events) == "cancelled"
    wait_until(lambda: upstream.held() == 0, "the upstream's running count to fall to 0")


def test_a_killed_workers_answer_continues_on_the_other_upstream_worker(
    tmp_path: Path,
    upstream: ServerProcess,
    redis_url: str,
    takeover_db: str,  # noqa: F811
    model_dir: Path,
) -> None:
    st = upstream_stack(tmp_path, upstream, redis_url, takeover_db, model_dir)
    try:
        procs = {"a": st.start_worker("a"), "b": st.start_worker("b")}
        st.start_api()

        def make() -> list[Stream]:
            """The answer to be interrupted, and two beside it (on either worker)."""
            questions = [
                "Write a long story about a robot who learns to paint.",
                "Describe a walk through an old city at dawn.",
                "Explain how a bicycle stays upright.",
            ]
            return [Stream(q, greedy()) for q in questions]

        a_kill_mid_answer_changes_nothing(st, procs, make)
        # the killed worker's connections closed: the upstream aborted what it ran for it
        wait_until(lambda: upstream.held() == 0, "the upstream to hold nothing")
    finally:
        st.stop()
