"""Each process's Prometheus endpoint, scraped with prometheus_client's own parser: the
API's ``/metrics``, a worker's and a recorder's on ``LASTEVENT_METRICS_PORT``. Counts
are asserted, never durations."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from httpx_sse import ServerSentEvent
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Stack, free_port, make_stack
from tests.e2e.helpers import chat_body, read_all
from tests.waiting import wait_until

REQUESTS = 3

Samples = list[tuple[str, dict[str, str], float]]


def scrape(url: str) -> Samples:
    reply = httpx.get(url, timeout=10)
    assert reply.status_code == 200, reply.text
    return [
        (s.name, s.labels, s.value)
        for family in text_string_to_metric_families(reply.text)
        for s in family.samples
    ]


def scrape_until(url: str, done: Callable[[Samples], bool], what: str) -> Samples:
    """The first scrape that is ``done``: a process counts a request when it has done its
    part, which may be after the client has read all of it."""

    def scraped() -> Samples | None:
        samples = scrape(url)
        return samples if done(samples) else None

    return wait_until(scraped, what, timeout=60)


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sum of ``name``'s samples that carry ``labels``; None: no such sample."""
    found = [v for n, ls, v in samples if n == name and labels.items() <= ls.items()]
    return sum(found) if found else None


@pytest.fixture(scope="module")
def metered(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[tuple[Stack, str, str]]:
    """A worker without a recorder of its own, a recorder, one API: their metrics URLs."""
    st = make_stack(
        tmp_path_factory.mktemp("metrics"),
        redis_url,
        database_url,
        model_dir,
        recorder_in_worker=False,
    )
    worker_port, recorder_port = free_port(), free_port()
    try:
        st.start_worker(metrics_port=worker_port)
        st._spawn("recorder", "recorder", worker_id="rec-metrics", metrics_port=recorder_port)
        st.start_api()
        yield (
            st,
            f"http://127.0.0.1:{worker_port}/metrics",
            f"http://127.0.0.1:{recorder_port}/metrics",
        )
    finally:
        st.stop()


def usage(events: list[ServerSentEvent]) -> dict[str, int]:
    chunks = [json.loads(e.data) for e in events if e.data and e.data != "[DONE]"]
    found: dict[str, int] = chunks[-1]["usage"]
    return found


def test_every_endpoint_counts_what_it_served(metered: tuple[Stack, str, str]) -> None:
    st, worker_url, recorder_url = metered
    used = []
    with httpx.Client(base_url=st.url, timeout=30) as client:
        for i in range(REQUESTS):
            body = chat_body(
                st.model,
                f"metrics request {i}",
                stream=True,
                stream_options={"include_usage": True},
            )
            headers, events = read_all(client, "POST", "/v1/chat/completions", json=body)
            used.append(usage(events))
        rid = headers["x-request-id"]
        _, resumed = read_all(
            client, "GET", f"/v1/requests/{rid}/events", headers={"Last-Event-ID": events[1].id}
        )
        assert resumed
        assert client.get("/v1/models/no-such-model").status_code == 404
        bad = chat_body(st.model, "hi", no_such_field=1)
        assert client.post("/v1/chat/completions", json=bad).status_code == 400
    completion = sum(u["completion_tokens"] for u in used)
    prompt = sum(u["prompt_tokens"] for u in used)

    worker = scrape_until(
        worker_url,
        lambda s: (
            value(s, "lastevent_request_duration_seconds_count", state="finished") == REQUESTS
        ),
        "the worker to count the requests' ends",
    )
    assert value(worker, "lastevent_time_to_first_token_seconds_count") == REQUESTS
    assert value(worker, "lastevent_queue_wait_seconds_count") == REQUESTS
    # labelled by the model asked for
    assert value(worker, "lastevent_completion_tokens_total", model=st.model) == completion
    assert value(worker, "lastevent_prompt_tokens_total", model=st.model) == prompt
    steps = completion - REQUESTS  # each choice's outputs after its first token
    assert (value(worker, "lastevent_inter_token_latency_seconds_count") or 0) >= steps
    assert (value(worker, "lastevent_engine_step_seconds_count") or 0) >= steps
    assert (value(worker, "lastevent_append_wait_seconds_count") or 0) >= REQUESTS
    assert value(worker, "lastevent_wasted_tokens_total") == 0
    assert value(worker, "lastevent_continued_total") == 0
    assert value(worker, "lastevent_handed_over_total") == 0
    assert value(worker, "lastevent_running_requests") is not None
    assert value(worker, "lastevent_worker_slots", model=st.model) == st.settings.worker_concurrency

    recorder = scrape_until(
        recorder_url,
        lambda s: value(s, "lastevent_recorded_total", result="new") == REQUESTS,
        "the recorder to record every request",
    )
    assert value(recorder, "lastevent_record_lag_seconds_count") == REQUESTS
    assert value(recorder, "lastevent_record_duration_seconds_count") == REQUESTS
    assert value(recorder, "lastevent_ledger_failures_total") == 0
    assert not value(recorder, "lastevent_time_to_first_token_seconds_count")  # not a worker

    api = scrape_until(
        st.url + "/metrics",
        lambda s: (value(s, "lastevent_event_loop_lag_seconds_count") or 0) > 0,
        "the API to measure its event loop",
    )
    chats = value(api, "lastevent_requests_total", kind="chat", stream="true", model=st.model)
    assert chats == REQUESTS
    assert value(api, "lastevent_resumes_total") == 1
    assert value(api, "lastevent_readers") is not None
    assert value(api, "lastevent_rejected_total", status="404", reason="model_not_found") == 1
    assert value(api, "lastevent_rejected_total", status="400", reason="validation_failed") == 1
