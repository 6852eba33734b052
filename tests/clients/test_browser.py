"""Real headless Chromium (Debian's /usr/bin/chromium through playwright-core; never a
downloaded browser) against a real stack through the cutting proxy:

- the playground (/playground, the JS client in a page): the answer shown is the question,
  with the proxy's cuts and one press of "Drop the connection";
- a page on another origin (CORS) following an answer with a plain ``EventSource`` and a
  stream token (``?token=``): the browser's own reconnects give the whole text, and the
  server's 204 at the end stops it (no reconnect loop).
- the playground with a key saved, opened by a link that names another server
  (``?baseUrl=``, a second HTTP server of the test: the "attacker", which answers CORS
  preflights as an attacker would): the attacker never receives the key, and the key is
  not in a new tab.

``LASTEVENT_SCREENSHOT=docs/playground.png`` saves the playground's picture there.
"""

from __future__ import annotations

import dataclasses
import functools
import http.server
import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import pytest

from service.api.routes.playground import STATIC
from tests.clients.conftest import (
    HERE,
    QUESTION,
    ClientStack,
    Origin,
    RecordingProxy,
    api_target,
)

# pytest-timeout counts the fixtures' setup (the session's stack, when this test is the
# first) as well as the browser's run: the script's own waits (100 s) run out first and
# say what the page showed, then node's (240 s), then this one.
pytestmark = [pytest.mark.clients, pytest.mark.timeout(300)]

CHROMIUM = Path(os.environ.get("LASTEVENT_CHROMIUM", "/usr/bin/chromium"))


@pytest.fixture(autouse=True)
def _chromium() -> None:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test-clients` installs Debian's chromium")


SPARED = ("GET /playground", "GET /static/", "GET /favicon.ico")  # the page's own files


def browser(node: Any, mode: str, env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = node(
        "js/browser.mjs", mode, env={**env, "CHROMIUM": str(CHROMIUM)}, timeout=240
    ).result()
    return out


def test_playground_through_cuts_and_a_drop(
    node: Any, clients_stack: ClientStack, api_key: str
) -> None:
    proxy = RecordingProxy(api_target(clients_stack), spared=SPARED)
    proxy.start()
    try:
        env = {
            # the model given: the page asks /v1/models nothing, so the first API call is
            # the POST (no keep-alive connection of another call to ride on)
            "PAGE_URL": f"{proxy.url}/playground?{urlencode({'model': clients_stack.model})}",
            "LASTEVENT_API_KEY": api_key,
            "LASTEVENT_MODEL": clients_stack.model,
            "QUESTION": QUESTION,
        }
        if os.environ.get("LASTEVENT_SCREENSHOT"):
            env["SCREENSHOT"] = str(Path(os.environ["LASTEVENT_SCREENSHOT"]).resolve())
        out = browser(node, "playground", env)
    finally:
        proxy.close()
    shown = out["shown"]
    answers = [(x.request[:40], x.response, x.cut, x.budget) for x in proxy.exchanges]
    assert shown["error"] == "", (shown, answers)
    assert shown["answer"] == QUESTION, out
    assert shown["state"] == "done"
    assert out["before"]["answer"] and out["before"]["answer"] != QUESTION  # dropped mid-answer
    assert any("dropped" in line for line in shown["log"]), shown["log"]
    assert shown["reconnects"] >= 1 and proxy.cuts > 0
    # the drop and the cuts are the only reconnects: one POST, then resumes of that request
    api = [line for line in proxy.requests if not line.startswith(SPARED)]
    posts = [line for line in api if line.startswith("POST /v1/chat/completions")]
    gets = [line for line in api if re.match(r"GET /v1/requests/[^/]+/events", line)]
    assert len(posts) >= 1 and len(posts) + len(gets) == len(api) == shown["reconnects"] + 1, api


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def other_page(other_origin: Origin) -> Iterator[str]:
    """tests/clients/js/ served on another origin (the one the stack's CORS allows)."""
    handler = functools.partial(_QuietHandler, directory=str(HERE / "js"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", other_origin.port), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield other_origin.url
    finally:
        server.shutdown()
        server.server_close()


# A response's header block here is ~560 bytes, CORS headers last (from ~320 on).
HEADERS_END = 800


def follow_with_event_source(
    node: Any, stack: ClientStack, api_key: str, proxy: RecordingProxy, page: str
) -> None:
    query = urlencode(
        {
            "api": stack.url,  # the submit: straight to the API (another origin too)
            "events": proxy.url,  # the EventSource: through the cutting proxy
            "key": api_key,
            "model": stack.model,
            "question": QUESTION,
        }
    )
    out = browser(node, "eventsource", {"PAGE_URL": f"{page}/eventsource.html?{query}"})
    result = out["result"]
    assert "failure" not in result, out
    assert result["status"] == 200 and result["token"]
    answers = [(x.response, x.cut, x.budget) for x in proxy.exchanges]
    assert result["text"] == QUESTION, (result, answers)
    assert result["done"] and result["after"] == 0
    assert result["closed"], result  # the 204 closed it: EventSource never reconnects now
    assert proxy.cuts > 0 and result["opens"] >= 2, (proxy.cuts, result)
    events = [line for line in proxy.requests if "/events?token=" in line]
    assert len(events) == len(proxy.requests), proxy.request_lines  # nothing else went there
    # every connection the browser made was one of its reconnects, and the last one the
    # 204: as many as the errors it saw (each connection ends in one), none after CLOSED
    assert len(events) <= result["errors"] + 1, (proxy.request_lines, result)


def test_event_source_on_another_origin_stops_at_the_end(
    node: Any, clients_stack: ClientStack, api_key: str, other_page: str
) -> None:
    """Cuts anywhere in the body (after the response headers)."""
    proxy = RecordingProxy(api_target(clients_stack), min_bytes=HEADERS_END, max_bytes=3000)
    proxy.start()
    try:
        follow_with_event_source(node, clients_stack, api_key, proxy, other_page)
    finally:
        proxy.close()


def test_event_source_survives_cuts_inside_the_response_headers(
    node: Any, clients_stack: ClientStack, api_key: str, other_page: str
) -> None:
    """The second and third connections are cut 330-360 bytes in: inside the header block,
    past its first ~200 bytes."""
    proxy = RecordingProxy(
        api_target(clients_stack), budgets=(1500, 340, 360), min_bytes=HEADERS_END
    )
    proxy.start()
    try:
        follow_with_event_source(node, clients_stack, api_key, proxy, other_page)
    finally:
        proxy.close()


def test_static_files_are_the_repository_files(clients_stack: ClientStack) -> None:
    """/static/lastevent.js is the canonical file, byte for byte; nothing else leaks out."""
    with httpx.Client(base_url=clients_stack.url, timeout=30) as c:
        js = c.get("/static/lastevent.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert js.content == (STATIC / "lastevent.js").read_bytes()
        page = c.get("/playground")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert b'<script type="module" src="/static/playground.js">' in page.content
        script = c.get("/static/playground.js")
        assert script.content == (STATIC / "playground.js").read_bytes()
        assert b'from "/static/lastevent.js"' in script.content
        for path in ("/static/nope.js", "/static/..%2Froutes%2Fplayground.py", "/static/%2e%2e"):
            assert c.get(path).status_code == 404, path


@dataclasses.dataclass
class Seen:
    """One request the attacker's server received."""

    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class _Attacker(http.server.BaseHTTPRequestHandler):
    """Records every request; answers preflights yes to anything (Authorization too, as an
    attacker would), everything else 404."""

    seen: list[Seen]

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def _record(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        body = self.rfile.read(length) if length else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.seen.append(Seen(self.command, self.path, headers, body))

    def _answer(self, status: int, extra: dict[str, str]) -> None:
        self.send_response(status)
        self.send_header("Access-Control-Allow-Origin", self.headers.get("origin") or "*")
        for name, value in extra.items():
            self.send_header(name, value)
        body = (
            b'{"error": {"message": "nothing here", "code": "not_found"}}' if status >= 400 else b""
        )
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_OPTIONS(self) -> None:
        self._record()
        self._answer(
            204,
            {
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": self.headers.get(
                    "access-control-request-headers", "*"
                ),
            },
        )

    def do_GET(self) -> None:
        self._record()
        self._answer(404, {})

    do_POST = do_GET


@pytest.fixture
def attacker() -> Iterator[tuple[str, list[Seen]]]:
    seen: list[Seen] = []
    handler = type("Attacker", (_Attacker,), {"seen": seen})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


def test_the_playground_never_hands_the_key_to_another_origin(
    node: Any, clients_stack: ClientStack, api_key: str, attacker: tuple[str, list[Seen]]
) -> None:
    """A key saved (typed in the tab; also left in localStorage by an older playground),
    then ``/playground?baseUrl=<attacker>&model=`` in the same tab and Send: the page
    ignores the address's server (says so) and answers from its own origin with the key.
    Then the attacker typed into the "Server" field and Send: the request goes there, but
    the key field emptied and no key goes with it. Then a new tab: no key anywhere."""
    attacker_url, seen = attacker
    question = "hello from the playground"
    env = {
        "PAGE_URL": f"{clients_stack.url}/playground",
        "ATTACKER_URL": attacker_url,
        "LASTEVENT_API_KEY": api_key,
        "QUESTION": question,
    }
    out = browser(node, "attacker", env)
    received = [(x.method, x.path, x.headers, x.body) for x in seen]  # to read on a failure
    assert all("authorization" not in x.headers for x in seen), received
    assert not any(api_key in repr((x.path, x.headers, x.body)) for x in seen), received
    assert out["saved"]["key"] == api_key
    linked = out["linked"]
    assert linked["server"] != attacker_url and attacker_url in linked["notice"], linked
    assert linked["answer"] == question and linked["error"] is None, linked  # own origin
    assert out["typedBeforeSend"]["key"] == "", out["typedBeforeSend"]
    assert "POST" in [x.method for x in seen], received  # the typed server was used
    assert out["typed"]["error"], out["typed"]  # the attacker's 404
    new_tab = out["newTab"]
    assert new_tab["key"] == "", new_tab
    stored = repr((new_tab["sessionStorage"], new_tab["localStorage"], new_tab["cookie"]))
    assert api_key not in stored, new_tab
    for step in ("saved", "linked", "typed", "newTab"):
        assert out[step]["violations"] == [], (step, out[step])
