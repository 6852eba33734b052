"""What a web or mobile client needs from the server: CORS, stream tokens (EventSource
cannot send Authorization), a stream that starts with ``retry:``, and idempotent submits
(a POST cut before its response, sent again, is the same request, not a second one).

Every page and file a browser loads from the API's origin (the static files, the
playground, the console, the OpenAPI spec under /schema) carries the console's headers
(CSP, framing guard, nosniff, no referrer) and loads no script from another origin.

The clients themselves (the JS and Python clients, EventSource, Chromium) are the
``make test-clients`` tier (tests/clients)."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from httpx_sse import EventSource

from service.api.static_files import STATIC
from service.store.keys import Keys
from tests.e2e.conftest import Stack, running
from tests.e2e.helpers import LONG, chat_body, content_of
from tests.e2e.test_auth import auth, make_key
from tests.waiting import wait_until

ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(
        tmp_path_factory.mktemp("browsers"),
        redis_url,
        database_url,
        model_dir,
        auth="required",
        cors_origins=f"{ORIGIN}, https://other.example",
        scripted_tokens_per_s=400.0,
    ) as st:
        yield st


@pytest.fixture(scope="module")
def key(stack: Stack, database_url: str) -> str:
    return make_key(database_url, "webshop")


def test_a_preflight_from_an_allowed_origin_is_answered(stack: Stack) -> None:
    pre = httpx.options(
        f"{stack.url}/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type, idempotency-key",
        },
    )
    assert pre.status_code in (200, 204), pre.text
    assert pre.headers["access-control-allow-origin"] == ORIGIN
    allowed = pre.headers["access-control-allow-headers"].lower()
    assert {"authorization", "content-type", "idempotency-key", "last-event-id"} <= {
        h.strip() for h in allowed.split(",")
    }
    other = httpx.options(
        f"{stack.url}/v1/chat/completions",
        headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
    )
    assert "access-control-allow-origin" not in other.headers


def test_a_cross_origin_post_exposes_the_request_id_and_the_stream_token(
    stack: Stack, key: str
) -> None:
    resp = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json=chat_body(stack.model, "hello there"),
        headers={**auth(key), "Origin": ORIGIN},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    assert resp.headers["access-control-allow-origin"] == ORIGIN
    exposed = {h.strip().lower() for h in resp.headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "x-stream-token", "retry-after"} <= exposed
    assert resp.headers["x-stream-token"]


def test_a_stream_token_reads_its_request_and_nothing_else(
    stack: Stack, key: str, database_url: str
) -> None:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        first = c.post("/v1/chat/completions", json=chat_body(stack.model, LONG), headers=auth(key))
        second = c.post("/v1/chat/completions", json=chat_body(stack.model, "x"), headers=auth(key))
        rid, token = first.headers["x-request-id"], first.headers["x-stream-token"]
        # no key, the token in the query (what EventSource can do): the whole stream
        with c.stream("GET", f"/v1/requests/{rid}/events", params={"token": token}) as r:
            assert r.status_code == 200
            events = list(EventSource(r).iter_sse())
        assert content_of(events) == LONG
        status = c.get(f"/v1/requests/{rid}", params={"token": token})
        assert status.status_code == 200 and status.json()["state"] == "finished"
        # another request's stream, another route, a forged or truncated token: 401
        other = second.headers["x-request-id"]
        for url in (f"/v1/requests/{other}/events", f"/v1/requests/{other}"):
            denied = c.get(url, params={"token": token})
            assert denied.status_code == 401, denied.text
            assert denied.json()["error"]["code"] == "invalid_stream_token"
        cancel = c.post(f"/v1/requests/{rid}/cancel", params={"token": token})
        assert cancel.status_code == 401
        assert cancel.json()["error"]["code"] == "stream_token_not_accepted"
        post = c.post(
            "/v1/chat/completions", json=chat_body(stack.model, "x"), params={"token": token}
        )
        assert post.status_code == 401
        forged = token[:-2] + ("AA" if not token.endswith("AA") else "BB")
        assert c.get(f"/v1/requests/{rid}", params={"token": forged}).status_code == 401
        # another tenant's token for this id would say another tenant: the same 404
        globex = make_key(database_url, "globex-browsers")
        theirs = c.post(
            "/v1/chat/completions", json=chat_body(stack.model, "y"), headers=auth(globex)
        )
        assert (
            c.get(f"/v1/requests/{theirs.headers['x-request-id']}", headers=auth(key)).status_code
            == 404
        )
    # the token never reaches the access log
    api_log = stack.tail("api-" + urlsplit(stack.url).port.__str__(), 10**7)
    assert f"/v1/requests/{rid}/events?token=[redacted]" in api_log
    assert token not in api_log


def test_models_need_a_key(stack: Stack, key: str) -> None:
    assert httpx.get(f"{stack.url}/v1/models").status_code == 401
    models = httpx.get(f"{stack.url}/v1/models", headers=auth(key))
    assert models.status_code == 200 and models.json()["data"][0]["id"] == stack.model


def test_every_stream_starts_with_a_reconnect_hint(stack: Stack, key: str) -> None:
    body = chat_body(stack.model, "hint", stream=True)
    with httpx.stream(
        "POST", f"{stack.url}/v1/chat/completions", json=body, headers=auth(key), timeout=30
    ) as r:
        raw = b"".join(r.iter_bytes())
        rid = r.headers["x-request-id"]
    assert raw.startswith(b"retry: 1000\n")
    again = httpx.get(f"{stack.url}/v1/requests/{rid}/events", headers=auth(key), timeout=30)
    assert again.content.startswith(b"retry: 1000\n")
    # data before id in every event
    for block in raw.split(b"\n\n"):
        lines = [line for line in block.split(b"\n") if line and not line.startswith(b":")]
        fields = [line.split(b":", 1)[0] for line in lines if not line.startswith(b"retry")]
        if b"id" in fields:
            assert fields.index(b"data") < fields.index(b"id"), block


def _count_requests(st: Stack) -> int:
    r = st.store()
    return sum(
        1
        for _ in r.scan_iter(
            match=f"{Keys(st.settings.key_prefix, st.settings.partitions).prefix}:*:meta"
        )
    )


def test_a_post_cut_before_its_response_is_not_run_twice(stack: Stack, key: str) -> None:
    """The client sends the POST and loses the connection before any response byte: it
    never learns the request id. Sent again with the same Idempotency-Key, it is the same
    request (the same id, the answer from its start) -- not a second generation."""
    before = _count_requests(stack)
    body = json.dumps(chat_body(stack.model, LONG, stream=True)).encode()
    host, port = urlsplit(stack.url).hostname or "", urlsplit(stack.url).port or 0
    with socket.create_connection((host, port)) as s:
        s.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {key}\r\nIdempotency-Key: order-4711\r\n".encode()
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
    wait_until(lambda: _count_requests(stack) == before + 1, "the first POST's request")
    headers = {**auth(key), "Idempotency-Key": "order-4711"}
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/chat/completions",
        json=chat_body(stack.model, LONG, stream=True),
        headers=headers,
        timeout=30,
    ) as r:
        assert r.status_code == 200
        assert r.headers["idempotent-replayed"] == "true"
        events = list(EventSource(r).iter_sse())
        rid = r.headers["x-request-id"]
    assert content_of(events) == LONG
    assert _count_requests(stack) == before + 1  # one request, one generation
    # once more, resuming after the fifth event: the rest only
    with httpx.stream(
        "POST",
        f"{stack.url}/v1/chat/completions",
        json=chat_body(stack.model, LONG, stream=True),
        headers={**headers, "Last-Event-ID": events[4].id},
        timeout=30,
    ) as r:
        rest = list(EventSource(r).iter_sse())
        assert r.headers["x-request-id"] == rid
    assert content_of(events[:5]) + content_of(rest) == LONG
    # the same key with another body: 422, and nothing is created
    other = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json=chat_body(stack.model, "something else"),
        headers=headers,
        timeout=30,
    )
    assert other.status_code == 422
    assert other.json()["error"]["code"] == "idempotency_key_reused"
    assert _count_requests(stack) == before + 1


def test_an_idempotent_non_streaming_post_answers_the_same(stack: Stack, key: str) -> None:
    headers = {**auth(key), "Idempotency-Key": "same-twice"}
    body = chat_body(stack.model, "the same answer twice")
    a = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
    b = httpx.post(f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=30)
    assert a.status_code == b.status_code == 200
    assert a.json()["id"] == b.json()["id"] == b.headers["x-request-id"]
    assert a.json()["choices"] == b.json()["choices"]
    assert "idempotent-replayed" not in a.headers
    bad = httpx.post(
        f"{stack.url}/v1/chat/completions",
        json=body,
        headers={**auth(key), "Idempotency-Key": "with space"},
        timeout=30,
    )
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_idempotency_key"


def test_a_client_with_it_all_gets_204_however_it_asks(stack: Stack, key: str) -> None:
    """At the terminal event (its last frame, or a frame past it; by GET or by the same
    idempotent POST again): 204, never a 200 that pings for ever."""
    headers = {**auth(key), "Idempotency-Key": "all-of-it"}
    body = chat_body(stack.model, "all of it", stream=True)
    with httpx.stream(
        "POST", f"{stack.url}/v1/chat/completions", json=body, headers=headers, timeout=30
    ) as r:
        events = list(EventSource(r).iter_sse())
        rid = r.headers["x-request-id"]
    last = events[-1].id
    base = last.split(":")[0]
    for cursor in (last, f"{base}:99"):
        got = httpx.get(
            f"{stack.url}/v1/requests/{rid}/events",
            headers={**auth(key), "Last-Event-ID": cursor},
            timeout=30,
        )
        assert got.status_code == 204, (cursor, got.text)
        again = httpx.post(
            f"{stack.url}/v1/chat/completions",
            json=body,
            headers={**headers, "Last-Event-ID": cursor},
            timeout=30,
        )
        assert again.status_code == 204, (cursor, again.text)
        assert again.headers["x-request-id"] == rid


# ---- what a browser loads from the API's origin ----------------------------------------------

PAGES = ("/playground", "/console", "/schema", "/schema/openapi.json", "/schema/openapi.yaml")
# the HTML UIs Litestar can serve under /schema: each loads unpinned scripts from a CDN
SCHEMA_UIS = ("swagger", "redoc", "elements", "rapidoc", "scalar")


class _Tags(HTMLParser):
    """The scripts, styles and linked resources of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.inline_scripts = 0
        self.sources: list[str] = []  # every src= and href= of script, link, img, iframe
        self.styles: list[str] = []  # <style> elements and style= attributes

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        named = dict(attrs)
        if tag == "script" and not named.get("src"):
            self.inline_scripts += 1
        if tag == "style" or "style" in named:
            self.styles.append(tag)
        if tag in ("script", "link", "img", "iframe", "embed", "object"):
            self.sources += [v or "" for k, v in attrs if k in ("src", "href", "data")]


def _policy(csp: str) -> dict[str, list[str]]:
    directives = [d.split() for d in csp.split(";") if d.strip()]
    return {d[0]: d[1:] for d in directives}


def assert_page_headers(path: str, resp: httpx.Response) -> None:
    policy = _policy(resp.headers.get("content-security-policy", ""))
    assert policy.get("default-src") == ["'none'"], (path, resp.headers)
    assert policy.get("script-src") == ["'self'"], (path, policy)  # no CDN, nothing inline
    assert policy.get("style-src") == ["'self'"], (path, policy)
    assert policy.get("frame-ancestors") == ["'none'"], (path, policy)
    assert policy.get("base-uri") == ["'none'"] and policy.get("form-action") == ["'none'"]
    assert resp.headers.get("x-frame-options") == "DENY", path
    assert resp.headers.get("x-content-type-options") == "nosniff", path
    assert resp.headers.get("referrer-policy") == "no-referrer", path


def assert_only_own_scripts(path: str, resp: httpx.Response) -> None:
    tags = _Tags()
    tags.feed(resp.text)
    for src in tags.sources:
        parts = urlsplit(src)
        assert src.startswith("data:") or not (parts.scheme or parts.netloc), (path, src)
    assert tags.inline_scripts == 0 and tags.styles == [], (path, tags.styles)


def test_every_page_on_the_api_origin_has_the_headers_and_no_foreign_script(
    stack: Stack,
) -> None:
    """Every file of service/api/static/ (at /static/<name>), the pages, the spec, and
    Litestar's schema UIs (gone: 404): the console's headers on each; an HTML one has no
    inline script or style and loads nothing from another origin."""
    files = [f"/static/{p.name}" for p in sorted(STATIC.iterdir()) if p.is_file()]
    assert "/static/console.html" in files and "/static/lastevent.js" in files
    uis = [f"/schema/{ui}" for ui in SCHEMA_UIS]
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        # (a NUL byte and a 300-byte name were errors of the OS on the way to a file: 500s)
        missing = (
            "/static/nope.js",
            "/static/%3Cscript%3E.html",
            "/static/a%00b.js",
            "/static/" + "a" * 300 + ".js",
        )
        for path in (*files, *PAGES, *uis, *missing):
            resp = c.get(path)
            wanted = 404 if path in (*uis, *missing) else 200
            assert resp.status_code == wanted, (path, resp.status_code)
            assert_page_headers(path, resp)
            if resp.headers["content-type"].startswith("text/html"):
                assert_only_own_scripts(path, resp)
        # the playground may talk to a server typed into it; the console to its own only
        playground = _policy(c.get("/playground").headers["content-security-policy"])
        assert playground["connect-src"] == ["'self'", "http:", "https:"]
        console = _policy(c.get("/console").headers["content-security-policy"])
        assert console["connect-src"] == ["'self'"]


def test_the_spec_is_served_as_json_and_yaml(stack: Stack) -> None:
    """/schema serves the spec itself (no UI), as JSON and the same as YAML."""
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        spec = c.get("/schema/openapi.json").json()
        assert c.get("/schema").json() == spec
        assert yaml.safe_load(c.get("/schema/openapi.yaml").text) == spec
    assert "/v1/chat/completions" in spec["paths"]
