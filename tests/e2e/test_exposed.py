"""A server on the open internet (issue 41): Host names, failed keys throttled per client
address, revoked keys and their stream tokens, readers bounded per request and per key,
a parked request's return admitted against its key's limit, probes never refused.

One stack with keys required and small limits; each test sends from its own loopback
address (127.0.0.x: Linux routes all of 127/8 to lo), so one test's failures never
throttle another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from httpx_sse import EventSource

from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import LONG, chat_body
from tests.e2e.test_auth import make_key
from tests.waiting import wait_until

PER_REQUEST, PER_KEY, IN_FLIGHT, FAILURES = 2, 3, 2, 3


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("exposed"),
        redis_url,
        database_url,
        model_dir,
        auth="required",
        auth_cache_s=0.5,
        allowed_hosts="localhost,[ip]",
        auth_failures_per_minute=FAILURES,
        max_readers_per_request=PER_REQUEST,
        max_readers_per_key=PER_KEY,
        max_concurrent_per_key=IN_FLIGHT,
        scripted_tokens_per_s=25.0,  # LONG: ~12 s, long enough to hold readers open
        park_after_s=0.5,
        presence_check_s=0.2,
    ) as st:
        yield st


def client(stack: Stack, source: str, key: str | None = None, **kw: Any) -> httpx.Client:
    """A client whose connections come from ``source`` (127.0.0.x)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    transport = httpx.HTTPTransport(local_address=source)
    return httpx.Client(base_url=stack.url, transport=transport, headers=headers, timeout=60, **kw)


def code(resp: httpx.Response) -> str:
    if resp.status_code < 400:
        return str(resp.status_code)
    return f"{resp.status_code} {resp.json()['error']['code']}"


def test_a_rebinding_page_s_host_name_is_refused(stack: Stack, database_url: str) -> None:
    key = make_key(database_url, "hosts")
    port = stack.url.rsplit(":", 1)[1]
    with client(stack, "127.0.0.10", key) as c:
        # a page at http://evil.example:port whose name now points at 127.0.0.1
        assert code(c.get("/v1/models", headers={"Host": f"evil.example:{port}"})) == (
            "400 host_not_allowed"
        )
        assert code(c.get("/healthz", headers={"Host": "evil.example"})) == "400 host_not_allowed"
        for host in (f"localhost:{port}", f"127.0.0.1:{port}", f"[::1]:{port}", "10.1.2.3"):
            assert code(c.get("/v1/models", headers={"Host": host})) == "200", host


def test_failed_keys_are_throttled_per_client_address(stack: Stack, database_url: str) -> None:
    good, fresh = make_key(database_url, "throttle"), make_key(database_url, "throttle")
    body = chat_body(stack.model, "hi", max_tokens=2)
    with client(stack, "127.0.0.11") as c:
        assert code(c.get("/v1/models", headers={"Authorization": f"Bearer {good}"})) == "200"
        for i in range(FAILURES):
            bad = {"Authorization": f"Bearer sk-le-guess{i}-0123456789abcdef"}
            assert code(c.post("/v1/chat/completions", json=body, headers=bad)) == (
                "401 invalid_api_key"
            )
        refused = c.get("/v1/models", headers={"Authorization": "Bearer sk-le-x-0123456789ab"})
        assert code(refused) == "429 too_many_auth_failures"
        assert 1 <= int(refused.headers["retry-after"]) <= 60
        # a key this process has not verified yet is not looked up from there either...
        assert code(c.get("/v1/models", headers={"Authorization": f"Bearer {fresh}"})) == (
            "429 too_many_auth_failures"
        )
        # ... nor a stream token; a key it knows still works (an office behind one address)
        token_read = c.get("/v1/requests/chatcmpl-x/events", params={"token": "st1.a.b"})
        assert code(token_read) == "429 too_many_auth_failures"
        assert code(c.get("/v1/models", headers={"Authorization": f"Bearer {good}"})) == "200"
    with client(stack, "127.0.0.12") as other:  # another address is not affected
        assert code(other.get("/v1/models", headers={"Authorization": f"Bearer {fresh}"})) == (
            "200"
        )


def cli(stack: Stack, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **stack.settings.to_env()}
    return subprocess.run(
        [sys.executable, "-m", "service.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_revoking_a_key_ends_it_and_its_stream_tokens(stack: Stack, database_url: str) -> None:
    key = make_key(database_url, "revoked")
    key_id = key.split("-")[2]
    with client(stack, "127.0.0.13", key) as c:
        made = c.post("/v1/chat/completions", json=chat_body(stack.model, "hi", max_tokens=3))
        assert made.status_code == 200
        rid, token = made.json()["id"], made.headers["x-stream-token"]
    with client(stack, "127.0.0.13") as anonymous:
        assert code(anonymous.get(f"/v1/requests/{rid}", params={"token": token})) == "200"
        listed = cli(stack, "keys", "list", "--tenant", "revoked")
        assert listed.returncode == 0, listed.stderr
        assert f"{key_id}\trevoked\tuser\t*\t" in listed.stdout and listed.stdout.endswith("-\n")
        revoked = cli(stack, "keys", "revoke", key)  # (the whole key names it too)
        assert revoked.returncode == 0, revoked.stderr + revoked.stdout
        assert cli(stack, "keys", "revoke", key_id).returncode == 1  # already revoked
        assert "\t-\n" not in cli(stack, "keys", "list", "--tenant", "revoked").stdout

        def refused() -> bool:
            read = anonymous.get(f"/v1/requests/{rid}", params={"token": token})
            return code(read) == "401 invalid_stream_token"

        wait_until(refused, "the stream token to be refused", timeout=30)
        own = anonymous.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert code(own) == "401 invalid_api_key"


@contextlib.contextmanager
def reader(c: httpx.Client, rid: str) -> Iterator[httpx.Response]:
    """A reader of ``rid``'s events, open until the block ends."""
    with c.stream("GET", f"/v1/requests/{rid}/events") as r:
        yield r


def opened(c: httpx.Client, rid: str) -> str:
    """What opening one more reader of ``rid`` answers (closed at once)."""
    with reader(c, rid) as r:
        return code(r) if r.status_code == 200 else f"{r.status_code} {_code(r)}"


def _code(r: httpx.Response) -> str:
    r.read()
    return str(r.json()["error"]["code"])


def test_readers_are_bounded_per_request_and_per_key(stack: Stack, database_url: str) -> None:
    key = make_key(database_url, "readers")
    body = chat_body(stack.model, LONG, stream=True)
    with client(stack, "127.0.0.14", key) as c, contextlib.ExitStack() as open_:
        # two long requests, their own streams held open (those are not extra readers)
        first, second = (
            open_.enter_context(c.stream("POST", "/v1/chat/completions", json=body)).headers[
                "x-request-id"
            ]
            for _ in range(2)
        )
        held = [open_.enter_context(reader(c, first)) for _ in range(PER_REQUEST)]
        assert all(r.status_code == 200 for r in held)
        over = c.get(f"/v1/requests/{first}/events")
        assert code(over) == "429 too_many_readers"
        assert "request" in over.json()["error"]["message"] and over.headers["retry-after"]
        held.append(open_.enter_context(reader(c, second)))
        assert held[-1].status_code == 200  # PER_KEY readers of the key's requests now
        over = c.get(f"/v1/requests/{second}/events")
        assert code(over) == "429 too_many_readers"
        assert "API key" in over.json()["error"]["message"]
        held[0].close()  # a reader that leaves gives its seat back
        wait_until(lambda: opened(c, second) == "200", "a seat to be given back", timeout=30)


def read_some_and_leave(c: httpx.Client, body: dict[str, Any], n: int) -> tuple[str, str]:
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        rid = r.headers["x-request-id"]
        for i, event in enumerate(EventSource(r).iter_sse()):
            if i + 1 == n:
                return rid, event.id
    raise AssertionError("the stream ended early")


def state_of(c: httpx.Client, rid: str) -> str:
    return str(c.get(f"/v1/requests/{rid}").json()["state"])


def test_a_parked_request_s_return_is_admitted_like_a_new_one(
    stack: Stack, database_url: str
) -> None:
    key = make_key(database_url, "parking")
    body = chat_body(stack.model, LONG, stream=True)
    with client(stack, "127.0.0.15", key) as c:
        parked, last_id = read_some_and_leave(c, body, 3)
        wait_until(lambda: state_of(c, parked) == "parked", "the request to park", timeout=30)
        # its slot is free while it is parked: IN_FLIGHT new requests are admitted...
        with contextlib.ExitStack() as open_:
            for _ in range(IN_FLIGHT):
                r = open_.enter_context(c.stream("POST", "/v1/chat/completions", json=body))
                assert r.status_code == 200
            # ... and a reader coming back to it would make one more: refused, still parked
            back = c.get(f"/v1/requests/{parked}/events", headers={"Last-Event-ID": last_id})
            assert code(back) == "429 too_many_concurrent_requests"
            assert int(back.headers["retry-after"]) >= 1
            assert state_of(c, parked) == "parked"
        # (the two ended with their readers gone: cancelled or parked, their slots free)

        def comes_back() -> bool:
            with c.stream(
                "GET", f"/v1/requests/{parked}/events", headers={"Last-Event-ID": last_id}
            ) as r:
                if r.status_code == 429:
                    return False
                assert r.status_code == 200
                return any(e.data == "[DONE]" for e in EventSource(r).iter_sse())

        wait_until(comes_back, "the parked request to go on and end", timeout=120)


def test_probes_are_answered_when_requests_are_refused(stack: Stack) -> None:
    # an API whose cap is small: max_streams + 100 requests at once
    # (keys off there: a request waits for its body, not refused for want of a key first)
    url = stack.start_api(max_streams=1, request_read_timeout_s=120, auth="off")
    host, port = url.removeprefix("http://").split(":")

    async def hold(n: int) -> list[asyncio.StreamWriter]:
        """``n`` requests whose bodies never come: each in flight until cut off."""
        writers = []
        for _ in range(n):
            _, w = await asyncio.open_connection(host, int(port))
            w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\n")
            w.write(b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
            await w.drain()
            writers.append(w)
        return writers

    async def probe() -> None:
        writers = await hold(130)
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:

                async def busy() -> bool:
                    return (await c.get("/v1/models")).status_code == 503

                for _ in range(300):  # (a safety net: until the gate counts them all)
                    if await busy():
                        break
                    await asyncio.sleep(0.1)
                refused = await c.get("/v1/models")
                assert code(refused) == "503 server_busy" and refused.headers["retry-after"]
                for path in ("/healthz", "/readyz"):
                    assert (await c.get(path)).status_code == 200, path
        finally:
            for w in writers:
                w.close()

    asyncio.run(probe())
