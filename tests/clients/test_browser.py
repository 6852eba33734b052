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

import asyncio
import functools
import http.server
import os
import random
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import pytest

from tests.clients.conftest import (
    HERE,
    QUESTION,
    ClientStack,
    Origin,
    RecordingProxy,
    api_target,
)
from tests.clients.proxy import _pipe

pytestmark = pytest.mark.clients

CHROMIUM = Path(os.environ.get("LASTEVENT_CHROMIUM", "/usr/bin/chromium"))


@pytest.fixture(autouse=True)
def _chromium() -> None:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: `make test-clients` installs Debian's chromium")


class PageSparingProxy(RecordingProxy):
    """The cutting proxy, except for the page's own files (/playground, /static/...):
    those connections are not cut, and are closed after their response (``Connection:
    close``), so the API calls never ride on them. A page cut at 300 bytes would not load."""

    SPARED = ("GET /playground", "GET /static/", "GET /favicon.ico")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        first = await reader.read(65536)
        line = first.split(b"\r\n", 1)[0].decode("latin-1")
        self.request_lines.append(line)
        spared = line.startswith(self.SPARED)
        if spared:
            head, sep, rest = first.partition(b"\r\n\r\n")
            head = re.sub(rb"\r\nconnection:[^\r]*", b"", head, flags=re.I)
            first = head + b"\r\nConnection: close" + sep + rest
        budget = None
        if self.cutting and not spared:
            budget = self._random.randint(self.min_bytes, self.max_bytes)
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        up_writer.write(first)
        upload = asyncio.create_task(_pipe(reader, up_writer, None))
        if await _pipe(up_reader, writer, budget):
            self.cuts += 1
        upload.cancel()
        for w in (writer, up_writer):
            w.close()


def browser(node: Any, mode: str, env: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = node(
        "js/browser.mjs", mode, env={**env, "CHROMIUM": str(CHROMIUM)}
    ).result()
    return out


def test_playground_through_cuts_and_a_drop(
    node: Any, clients_stack: ClientStack, api_key: str
) -> None:
    proxy = PageSparingProxy(api_target(clients_stack), seed=random.randrange(1 << 30))
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
    assert shown["error"] == "", out
    assert shown["answer"] == QUESTION, out
    assert shown["state"] == "done"
    assert out["before"]["answer"] and out["before"]["answer"] != QUESTION  # dropped mid-answer
    assert any("dropped" in line for line in shown["log"]), shown["log"]
    assert shown["reconnects"] >= 1 and proxy.cuts > 0
    # the drop and the cuts are the only reconnects: one POST, then resumes of that request
    api = [line for line in proxy.requests if not line.startswith(PageSparingProxy.SPARED)]
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


def test_event_source_on_another_origin_stops_at_the_end(
    node: Any,
    clients_stack: ClientStack,
    api_key: str,
    proxy: RecordingProxy,
    other_page: str,
) -> None:
    query = urlencode(
        {
            "api": clients_stack.url,  # the submit: straight to the API (another origin too)
            "events": proxy.url,  # the EventSource: through the cutting proxy
            "key": api_key,
            "model": clients_stack.model,
            "question": QUESTION,
        }
    )
    out = browser(node, "eventsource", {"PAGE_URL": f"{other_page}/eventsource.html?{query}"})
    result = out["result"]
    assert "failure" not in result, out
    assert result["status"] == 200 and result["token"]
    assert result["text"] == QUESTION, result
    assert result["done"] and result["after"] == 0
    assert result["closed"], result  # the 204 closed it: EventSource never reconnects now
    assert proxy.cuts > 0 and result["opens"] >= 2, (proxy.cuts, result)
    events = [line for line in proxy.requests if "/events?token=" in line]
    assert len(events) == len(proxy.requests), proxy.request_lines  # nothing else went there
    # every connection the browser made was one of its reconnects, and the last one the
    # 204: as many as the errors it saw (each connection ends in one), none after CLOSED
    assert len(events) <= result["errors"] + 1, (proxy.request_lines, result)
