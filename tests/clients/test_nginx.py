"""A real proxy in front: Debian's nginx running ``ops/nginx.conf`` as shipped (TLS with a
test CA's certificate, HTTP/2), in front of two API processes and a worker, with the
clients a deployment on the open internet has -- the official ``openai`` SDK, an HTTP/2
client, Chromium's EventSource, a phone that cuts and resumes across an ``nginx -s
reload`` and a SIGKILL and restart of an API process -- and what the proxy must keep:
pings that outlast its read timeout, stream tokens out of its access log, and the
client's own address (not one it claims in X-Forwarded-For) for throttling.

The stack's pings come every ``KEEPALIVE_S``; nginx's proxy_read_timeout is set to
``READ_TIMEOUT_S``, above it as the shipped 1 h is above the default 15 s. One worker slot:
a second request waits in the queue, silent but for pings, for as long as the first runs.
"""

from __future__ import annotations

import random
import re
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import httpx2
import openai
import pytest

from service.settings import Settings
from tests.clients import sse_frames
from tests.clients.conftest import HERE, QUESTION, Origin, make_key
from tests.clients.nginx import SHIPPED, Edge, EdgeStack, serve_folder, shipped_read_timeout_s
from tests.clients.sse_frames import event_frames, frame_id, read_some, text_of
from tests.e2e.conftest import free_port, make_stack
from tests.waiting import wait_until

pytestmark = [pytest.mark.clients, pytest.mark.timeout(300)]

TOKENS_PER_S = 30.0  # QUESTION (~300 tokens) takes ~10 s
KEEPALIVE_S = 1.0
READ_TIMEOUT_S = 4  # nginx's proxy_read_timeout here: above the pings' interval
AUTH_FAILURES_PER_MINUTE = 5
USER = [{"role": "user", "content": QUESTION}]


@pytest.fixture(scope="module")
def page_origin() -> Origin:
    return Origin(free_port())


@pytest.fixture(scope="module")
def edge_stack(
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,
    database_url: str,
    model_dir: Path,
    page_origin: Origin,
) -> Iterator[EdgeStack]:
    base = make_stack(
        tmp_path_factory.mktemp("edge"),
        redis_url,
        database_url,
        model_dir,
        auth="required",
        scripted_tokens_per_s=TOKENS_PER_S,
        keepalive_s=KEEPALIVE_S,
        worker_concurrency=1,
    )
    st = EdgeStack(
        settings=base.settings,
        logs=base.logs,
        extra={
            "cors_origins": page_origin.url,
            "reconnect_hint_ms": 250,
            # the whole loopback network: the clients' addresses (127.0.0.2, .3) as well
            # as nginx's. Even so, only nginx's own X-Forwarded-For may name the client.
            "trusted_proxies": "127.0.0.0/8",
            "auth_failures_per_minute": AUTH_FAILURES_PER_MINUTE,
        },
        ports=[free_port(), free_port()],
    )
    try:
        st.start_worker()
        for port in st.ports:
            st.start_api_at(port)
        yield st
    finally:
        st.stop()


@pytest.fixture(scope="module")
def edge(tmp_path_factory: pytest.TempPathFactory, edge_stack: EdgeStack) -> Iterator[Edge]:
    upstreams = [f"127.0.0.1:{port}" for port in edge_stack.ports]
    e = Edge(tmp_path_factory.mktemp("nginx"), upstreams, read_timeout_s=READ_TIMEOUT_S)
    try:
        yield e.start()
    finally:
        e.stop()


@pytest.fixture(scope="module")
def key(edge_stack: EdgeStack, database_url: str) -> str:
    return make_key(database_url, "edge")


def client(edge: Edge, *, http2: bool = False, source: str | None = None) -> httpx.Client:
    transport = httpx.HTTPTransport(verify=edge.tls(), http2=http2, local_address=source)
    return httpx.Client(base_url=edge.url, transport=transport, timeout=60)


def chat(question: str = QUESTION, **more: Any) -> dict[str, Any]:
    return {
        "model": Settings().model_name,
        "messages": [{"role": "user", "content": question}],
        "stream": True,
        **more,
    }


def whole_stream(stack: EdgeStack, key: str, request_id: str) -> list[bytes]:
    """Every event of the request, read from the start straight from an API process."""
    with (
        httpx.Client(base_url=stack.api_urls[-1], timeout=60) as c,
        c.stream(
            "GET",
            f"/v1/requests/{request_id}/events",
            headers={"Authorization": f"Bearer {key}"},
        ) as r,
    ):
        assert r.status_code == 200
        return list(event_frames(r))


# ------------------------------------------------------------------------- clients


def test_openai_sdk_streams_through_nginx_over_https(edge: Edge, key: str) -> None:
    # (the SDK's own HTTP client, httpx2, told to trust the test CA)
    with httpx2.Client(verify=edge.tls(), timeout=60) as http:
        sdk = openai.OpenAI(base_url=edge.url + "/v1", api_key=key, http_client=http, max_retries=0)
        stream = sdk.chat.completions.create(
            model=Settings().model_name, messages=USER, stream=True
        )
        text, finish = "", None
        for chunk in stream:
            for choice in chunk.choices:
                text += choice.delta.content or ""
                finish = choice.finish_reason or finish
    assert text == QUESTION
    assert finish == "stop"


def test_http2_client_streams_and_resumes(edge: Edge, edge_stack: EdgeStack, key: str) -> None:
    """Over one HTTP/2 connection: the POST's stream read in part and reset, then the rest
    with Last-Event-ID: together, the whole stream, each event once."""
    auth = {"Authorization": f"Bearer {key}"}
    with client(edge, http2=True) as c:
        with c.stream("POST", "/v1/chat/completions", json=chat(), headers=auth) as r:
            assert r.status_code == 200 and r.http_version == "HTTP/2"
            request_id = r.headers["x-request-id"]
            frames = []
            for frame in event_frames(r):
                frames.append(frame)
                if len(frames) == 20:
                    break
        headers = {**auth, "Last-Event-ID": frame_id(frames[-1])}
        with c.stream("GET", f"/v1/requests/{request_id}/events", headers=headers) as r:
            assert r.status_code == 200 and r.http_version == "HTTP/2"
            frames += list(event_frames(r))
    assert frames == whole_stream(edge_stack, key, request_id)
    assert text_of(frames) == QUESTION


@pytest.fixture
def page(page_origin: Origin) -> Iterator[str]:
    """tests/clients/js/ served on another origin (the one the stack's CORS allows)."""
    with serve_folder(HERE / "js", page_origin.port):
        yield page_origin.url


def test_chromium_event_source_through_nginx(node: Any, edge: Edge, key: str, page: str) -> None:
    """A page of another origin submits through nginx and follows the answer with a
    plain EventSource and its stream token, over HTTP/2: the whole text, then the 204
    closes it. nginx's access log has the stream's request with the token redacted."""
    query = urlencode(
        {
            "api": edge.url,
            "events": edge.url,
            "key": key,
            "model": Settings().model_name,
            "question": QUESTION,
        }
    )
    out = node(
        "js/nginx_eventsource.mjs", env={"PAGE_URL": f"{page}/eventsource.html?{query}"}
    ).result()
    result = out["result"]
    assert "failure" not in result, out
    assert result["status"] == 200 and result["token"]
    assert result["text"] == QUESTION, result
    assert result["done"] and result["after"] == 0 and result["closed"], result
    # the request's lines in nginx's log: over HTTP/2, the token's value redacted
    rid = result["requestId"]
    log = wait_until(lambda: f"/v1/requests/{rid}/events" in edge.log() and edge.log(), what="log")
    assert '"POST /v1/chat/completions HTTP/2.0" 200' in log
    assert f'"GET /v1/requests/{rid}/events?token=[redacted] HTTP/2.0" 200' in log, log
    assert result["token"] not in log and quote(result["token"], safe="") not in log


# ---------------------------------------------------------------------- a phone


def test_a_phone_cuts_and_resumes_across_a_reload_and_an_api_restart(
    edge: Edge, edge_stack: EdgeStack, key: str
) -> None:
    """Every connection cut after a few events, then resumed with Last-Event-ID; on the
    way nginx reloads, one API process is killed (SIGKILL) while a stream is open, and
    started again on its port (nginx reloaded to take it back at once). The events it
    gets are exactly those of a fresh full read; every response was 200, and the
    restarted process served some of the resumes."""
    rng = random.Random(41)
    auth = {"Authorization": f"Bearer {key}"}
    victim = edge_stack.api_urls[0]
    victim_port = victim.rsplit(":", 1)[1]
    got: list[bytes] = []
    statuses: list[int] = []
    restarted_at: int | None = None
    with client(edge) as c:
        body = chat(QUESTION + " " + QUESTION, max_tokens=2000)
        post = {**auth, "Idempotency-Key": uuid.uuid4().hex}
        with c.stream("POST", "/v1/chat/completions", json=body, headers=post) as r:
            statuses.append(r.status_code)
            request_id = r.headers["x-request-id"]
            done = read_some(r, got, rng.randint(1, 6))
        connection = 1
        while not done and connection < 2000:
            connection += 1
            if connection == 5:
                edge.reload()
            headers = {**auth, "Last-Event-ID": frame_id(got[-1])}
            with c.stream("GET", f"/v1/requests/{request_id}/events", headers=headers) as r:
                statuses.append(r.status_code)
                done = read_some(r, got, rng.randint(1, 6))
                if connection == 10:  # mid-stream
                    edge_stack.kill_api(victim)
            if connection == 15:
                edge_stack.start_api_at(int(victim_port))
                edge.reload()
                restarted_at = len(edge.log())
    assert done, f"no end after {connection} connections"
    assert set(statuses) == {200}, statuses
    assert got == whole_stream(edge_stack, key, request_id)
    assert text_of(got) == QUESTION + " " + QUESTION
    assert restarted_at is not None
    after = edge.log()[restarted_at:]
    assert re.search(rf"/events HTTP/1.1\" 200 .* up=(\S+, )*127.0.0.1:{victim_port} ", after), (
        after
    )


# ------------------------------------------------------------------------- pings


def test_pings_keep_a_queued_stream_open_past_the_proxy_read_timeout(
    edge: Edge, edge_stack: EdgeStack, key: str
) -> None:
    """The one worker slot busy with a first request, a second one (streamed) and a third
    (not streamed: silent until its answer is done) wait in the queue. nginx gives up on
    the silent one -- 504 after its read timeout -- while the streamed one, waiting at
    least as long, gets nothing but pings, stays open and then gets its whole answer."""
    assert shipped_read_timeout_s(SHIPPED.read_text()) > Settings().keepalive_s
    assert READ_TIMEOUT_S > KEEPALIVE_S
    auth = {"Authorization": f"Bearer {key}"}
    silent: dict[str, Any] = {}

    def not_streamed() -> None:
        with client(edge) as c:
            r = c.post("/v1/chat/completions", json=chat(stream=False), headers=auth)
            silent["status"] = r.status_code

    with (
        client(edge) as c,
        client(edge) as c2,
        c.stream("POST", "/v1/chat/completions", json=chat(), headers=auth) as first,
    ):
        assert first.status_code == 200
        first_events = event_frames(first)
        # its first text: the worker's one slot is this request's now
        next(e for e in first_events if text_of([e]))
        drain = threading.Thread(target=lambda: list(first_events))
        drain.start()
        with c2.stream("POST", "/v1/chat/completions", json=chat(), headers=auth) as queued:
            assert queued.status_code == 200
            third = threading.Thread(target=not_streamed)
            third.start()
            pings, frames, seen = 0, list[bytes](), dict[str, Any]()
            for kind, frame in sse_frames.frames(queued):
                frames += [frame] if kind == "event" else []
                if not seen and kind == "event" and text_of([frame]):
                    seen = {**silent}  # as the answer's first text came
                pings += kind == "ping" and not seen
            third.join(timeout=60)
        drain.join(timeout=60)
    assert silent["status"] == 504  # nginx's read timeout, for a response with no pings
    # it came while the queued stream had had nothing of its answer, only pings: a silence
    # longer than the read timeout
    assert seen == {"status": 504}, seen
    assert pings >= READ_TIMEOUT_S / KEEPALIVE_S
    assert text_of(frames) == QUESTION and frames[-1].startswith(b"data: [DONE]")


# ------------------------------------------------------------------- access log


def test_stream_tokens_never_reach_the_access_log(edge: Edge, key: str) -> None:
    with client(edge) as c:
        r = c.post(
            "/v1/chat/completions",
            json=chat("a short one", max_tokens=4, stream=False),
            headers={"Authorization": f"Bearer {key}"},
        )
        assert r.status_code == 200
        request_id, token = r.headers["x-request-id"], r.headers["x-stream-token"]
        for query in (f"token={token}", f"speed=2&token={token}&token={token}"):
            got = c.get(f"/v1/requests/{request_id}/events?{query}")
            assert got.status_code in (200, 204), got.text

    def both_logged() -> str:
        log = edge.log()
        return log if log.count(f"/v1/requests/{request_id}/events?") == 2 else ""

    log = wait_until(both_logged, what="both requests in nginx's log")
    assert f'"GET /v1/requests/{request_id}/events?token=[redacted] HTTP/1.1" 200' in log, log
    assert "/events?speed=2&token=[redacted]&token=[redacted] HTTP/1.1" in log, log
    assert token not in log and quote(token, safe="") not in log


# ------------------------------------------------------------------ X-Forwarded-For


def test_a_client_is_throttled_as_the_address_it_connects_from(edge: Edge, key: str) -> None:
    """From 127.0.0.2, failed keys each sent with another X-Forwarded-For: they all count
    against 127.0.0.2, which gets 429 too_many_auth_failures; a client on 127.0.0.3 is
    not throttled for it."""
    refused: list[httpx.Response] = []
    with client(edge, source="127.0.0.2") as spoofer:
        for i in range(6 * AUTH_FAILURES_PER_MINUTE):
            r = spoofer.get(
                "/v1/models",
                headers={
                    "Authorization": f"Bearer sk-le-nope{i}-{'x' * 24}",
                    "X-Forwarded-For": f"203.0.113.{i % 250 + 1}",
                },
            )
            assert r.status_code in (401, 429), r.text
            if r.status_code == 429:
                refused.append(r)
                break
    assert refused, "never throttled: the spoofed X-Forwarded-For was believed"
    assert refused[0].json()["error"]["code"] == "too_many_auth_failures"
    assert int(refused[0].headers["retry-after"]) > 0
    with client(edge, source="127.0.0.3") as other:
        bad = other.get("/v1/models", headers={"Authorization": "Bearer sk-le-nope-other"})
        assert bad.status_code == 401, bad.text
        good = other.get("/v1/models", headers={"Authorization": f"Bearer {key}"})
        assert good.status_code == 200, good.text


def test_the_shipped_config_sets_the_forwarded_address_and_redacts_tokens() -> None:
    """What the tests above run, said of the file itself: nginx is the edge."""
    shipped = SHIPPED.read_text()
    assert re.search(r"^\s*proxy_set_header X-Forwarded-For \$remote_addr;", shipped, re.M)
    assert "$proxy_add_x_forwarded_for" not in shipped
    assert not re.search(r"log_format[^;]*\$request[ \"']", shipped)
