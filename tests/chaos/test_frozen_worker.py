"""A worker frozen (SIGSTOP) while jobs arrive takes no work: what its blocked read
received is queued again for the other worker once its heartbeat is stale, and when it
wakes up (SIGCONT) its claims are refused, so nothing is written twice. Whether the
freeze catches a job depends on its read being blocked right then; the sweeper's side
is tested deterministically in tests/integration/test_sweeper.py."""

from __future__ import annotations

import concurrent.futures
import os
import signal
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import make_stack
from tests.e2e.helpers import chat_body, ledger_row

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(240)]


def test_jobs_a_frozen_worker_took_are_served_by_the_other(
    tmp_path: Path, redis_url: str, database_url: str, model_dir: Path
) -> None:
    st = make_stack(
        tmp_path,
        redis_url,
        database_url,
        model_dir,
        scripted_tokens_per_s=100.0,
        worker_stale_s=2.0,
        worker_concurrency=4,
    )
    frozen = None
    try:
        frozen = st.start_worker("frozen")
        st.start_worker("healthy")
        st.start_api()
        os.kill(frozen.pid, signal.SIGSTOP)  # blocked in XREADGROUP: it may still be handed jobs
        texts = [f"request number {i} asks for its own echo" for i in range(16)]
        with (
            httpx.Client(base_url=st.url, timeout=120) as client,
            concurrent.futures.ThreadPoolExecutor(8) as pool,
        ):
            answers = list(
                pool.map(
                    lambda t: client.post("/v1/chat/completions", json=chat_body(st.model, t)),
                    texts,
                )
            )
            os.kill(frozen.pid, signal.SIGCONT)
            for text, resp in zip(texts, answers, strict=True):
                assert resp.status_code == 200, resp.text
                body = resp.json()
                assert body["choices"][0]["message"]["content"] == text  # whole, once
                assert body["choices"][0]["finish_reason"] == "stop"
            # the woken worker writes nothing into them: each log stays as it ended
            for resp in answers:
                rid = resp.json()["id"]
                events = client.get(f"/v1/requests/{rid}/events").text
                assert events.count("[DONE]") == 1
                row = ledger_row(database_url, rid)
                assert row is not None and row["state"] == "finished"
        api_log = st.tail("api-" + st.url.rsplit(":", 1)[1], 10**7)
        requeued = api_log.count("queued again")  # a figure: how many the freeze caught
        print(f"jobs queued again after the freeze: {requeued}")
    finally:
        if frozen is not None and frozen.poll() is None:
            os.kill(frozen.pid, signal.SIGCONT)
        st.stop()
