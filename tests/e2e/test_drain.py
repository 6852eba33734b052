"""SIGTERM with open streams: the API tells them to reconnect, exits within its drain
time, and the streams resume on another API process."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from httpx_sse import EventSource, ServerSentEvent

from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import LONG, assert_ids_increase, chat_body, content_of, read_all


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("drain"),
        redis_url,
        database_url,
        model_dir,
        apis=2,
        scripted_tokens_per_s=40.0,
        drain_s=5.0,
        reconnect_hint_ms=250,
    ) as st:
        yield st


def read_until_drained(
    url: str, body: dict[str, object], proc: subprocess.Popen[bytes], after: int
) -> tuple[str, list[ServerSentEvent], int | None, float]:
    """POST ``body`` to ``url`` as a stream, SIGTERM the API ``proc`` after ``after``
    events, read on until the stream closes: (request id, the events with data, the
    reconnect hint, when the SIGTERM was sent)."""
    seen: list[ServerSentEvent] = []
    retry = None
    sent_at = 0.0
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=body) as r:
        rid = r.headers["x-request-id"]
        for event in EventSource(r).iter_sse():
            if event.retry is not None:
                retry = event.retry
            if event.data:
                seen.append(event)
            if len(seen) == after and not sent_at:
                sent_at = time.monotonic()
                proc.send_signal(signal.SIGTERM)
    return rid, seen, retry, sent_at


def exited(proc: subprocess.Popen[bytes], stack: Stack, log_name: str) -> None:
    """Wait for the drained API ``proc`` to exit (a generous safety net); one that hangs
    is asked where its tasks wait (SIGUSR1) and the test fails with its log."""
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(2)
        pytest.fail("the API did not exit after SIGTERM:\n" + stack.tail(log_name, 20_000))


def test_sigterm_tells_streams_to_reconnect_and_they_resume_elsewhere(stack: Stack) -> None:
    doomed, survivor = stack.api_urls
    api_proc = stack.procs[1]  # procs: worker, first API, second API
    doomed_log = f"api-{doomed.rsplit(':', 1)[1]}"
    body = chat_body(stack.model, LONG, stream=True)
    url = doomed + "/v1/chat/completions"
    rid, seen, retry, sent_at = read_until_drained(url, body, api_proc, 5)
    ended_at = time.monotonic()
    assert retry == 250  # the reconnect hint arrived, then the stream closed
    assert seen[-1].data != "[DONE]"  # truncated, not finished: the client resumes it
    exited(api_proc, stack, doomed_log)  # it exits by itself
    exited_at = time.monotonic()
    print(
        f"\ndrain: stream closed {1000 * (ended_at - sent_at):.0f} ms after SIGTERM, "
        f"process gone after {1000 * (exited_at - sent_at):.0f} ms (drain limit 5000 ms)"
    )
    # within its drain time: the open stream closed itself, uvicorn had nothing to cancel
    # when the drain time ran out, and the process shut down to the end
    log = stack.tail(doomed_log, 1_000_000)
    assert "timeout graceful shutdown exceeded" not in log, log[-3000:]
    assert "Finished server process" in log, log[-3000:]
    with pytest.raises(httpx.ConnectError):
        httpx.get(doomed + "/healthz", timeout=2)
    with httpx.Client(base_url=survivor, timeout=30) as client:
        _, rest = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": seen[-1].id}
        )
    assert_ids_increase(seen + rest)
    assert content_of(seen + rest) == LONG


def test_sigterm_tells_responses_streams_to_reconnect_too(stack: Stack) -> None:
    """A Responses stream on a draining API process gets the reconnect hint and closes;
    it resumes elsewhere after its last sequence number (its ``Last-Event-ID``)."""
    doomed = stack.start_api()
    api_proc = stack.procs[-1]
    survivor = stack.api_urls[1]  # (the first test's doomed process is api_urls[0])
    body = {"model": stack.model, "input": LONG, "stream": True}
    rid, seen, retry, _ = read_until_drained(doomed + "/v1/responses", body, api_proc, 6)
    assert retry == 250  # the reconnect hint arrived, then the stream closed
    assert seen[-1].event != "response.completed"  # cut short: the client resumes it
    exited(api_proc, stack, f"api-{doomed.rsplit(':', 1)[1]}")
    with (
        httpx.Client(base_url=survivor, timeout=30) as client,
        client.stream(
            "GET",
            f"/v1/responses/{rid}",
            params={"stream": "true"},
            headers={"Last-Event-ID": seen[-1].id},
        ) as r,
    ):
        rest = [e for e in EventSource(r).iter_sse() if e.data]
    numbers = [int(e.id) for e in seen + rest]
    assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))  # no gap, no repeat
    deltas = [e for e in seen + rest if e.event == "response.output_text.delta"]
    assert "".join(json.loads(e.data)["delta"] for e in deltas) == LONG
    assert rest[-1].event == "response.completed"
