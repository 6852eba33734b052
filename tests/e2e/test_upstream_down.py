"""An upstream that refuses connections makes its worker stop claiming, not fail jobs.

The worker is started in front of a port where nothing listens (the server is down, or
not up yet): it starts, its heartbeat offers no slots, and a request sent meanwhile is
accepted and waits in the queue -- no job is taken and failed. When the server comes up
on that port (another lastevent stack: a real OpenAI-compatible server), the worker sees
it answer, claims the request and streams the whole answer to the waiting client.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest
from httpx_sse import EventSource
from redis.asyncio import Redis

from service.store.heartbeats import Heartbeats
from service.store.keys import Keys
from tests.e2e.conftest import free_port, make_stack
from tests.e2e.helpers import chat_body, content_of, wait_state
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(240)


def slots_offered(url: str, keys: Keys) -> list[int]:
    async def read() -> list[int]:
        redis = Redis.from_url(url)
        try:
            return [b.slots for b in await Heartbeats(redis, keys).live(30.0)]
        finally:
            await redis.aclose()

    return asyncio.run(read())


def test_a_worker_waits_for_its_upstream_instead_of_failing_jobs(
    tmp_path: Path, redis_url: str, database_url: str, model_dir: Path
) -> None:
    port = free_port()  # the upstream's, not listening yet
    front = make_stack(
        tmp_path / "front",
        redis_url,
        database_url,
        model_dir,
        engine="upstream",
        upstream_mode="text",
        upstream_url=f"http://127.0.0.1:{port}/v1",
    )
    upstream = make_stack(tmp_path / "upstream", redis_url, database_url, model_dir)
    try:
        front.start_worker()
        front.start_api()
        keys = Keys(front.settings.key_prefix, front.settings.partitions)
        wait_until(lambda: slots_offered(redis_url, keys) == [0], "a heartbeat with no slots")
        got: dict[str, object] = {}

        def client() -> None:  # a client that waits for the answer meanwhile
            with (
                httpx.Client(timeout=180) as c,
                c.stream(
                    "POST",
                    front.url + "/v1/chat/completions",
                    json=chat_body(front.model, "still here", stream=True),
                ) as r,
            ):
                got["status"], got["rid"] = r.status_code, r.headers.get("x-request-id")
                got["events"] = list(EventSource(r).iter_sse())

        reader = threading.Thread(target=client)
        reader.start()
        wait_until(lambda: "rid" in got, "the request to be accepted")
        assert got["status"] == 200
        rid = str(got["rid"])
        status = httpx.get(f"{front.url}/v1/requests/{rid}", timeout=30).json()
        assert status["state"] == "queued", status  # not claimed, so not failed
        upstream.start_worker()
        upstream.start_api(port=port)  # the server comes up where the worker looks
        reader.join(timeout=180)
        assert not reader.is_alive()
        assert content_of(got["events"]).strip() == "still here"  # type: ignore[arg-type]
        assert wait_state(front.url, rid, {"finished", "errored"})["state"] == "finished"
        full = [front.settings.worker_concurrency]
        wait_until(lambda: slots_offered(redis_url, keys) == full, "its slots offered again")
    finally:
        front.stop()
        upstream.stop()
