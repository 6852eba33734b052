"""Real headless Chromium (Debian's /usr/bin/chromium through playwright-core; never a
downloaded browser) against a real stack through the cutting proxy:

- the playground (/playground, the JS client in a page): the answer shown is the question,
  with the proxy's cuts and one press of "Drop the connection";
- a page on another origin (CORS) following an answer with a plain ``EventSource`` and a
  stream token (``?token=``): the browser's own reconnects give the whole text, and the
  server's 204 at the end stops it (no reconnect loop).

``LASTEVENT_SCREENSHOT=docs/playground.png`` saves the playground's picture there.
"""

from __future__ import annotations

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
        assert b'from "/static/lastevent.js"' in page.content
        for path in ("/static/nope.js", "/static/..%2Froutes%2Fplayground.py", "/static/%2e%2e"):
            assert c.get(path).status_code == 404, path
