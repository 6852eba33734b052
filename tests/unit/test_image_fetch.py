"""A remote image URL, fetched by the API only when an operator allows it
(``image_fetch``), within ``image_max_bytes`` and ``image_fetch_timeout_s``: against a
real HTTP server on localhost (``service/api/images.fetch``)."""

from __future__ import annotations

import base64
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from service.api.images import fetch
from service.errors import InvalidRequest
from service.settings import Settings
from service.stream.images import ImageRefused, Remote

# a 1x1 PNG
PNG = base64.b64decode(
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="
)

ROUTES: dict[str, tuple[int, str, bytes]] = {
    "/cat.png": (200, "image/png", PNG),
    "/typed-wrong.png": (200, "image/jpeg", PNG),
    "/untyped.png": (200, "application/octet-stream", PNG),
    "/page.html": (200, "text/html", b"<html></html>"),
    "/big.png": (200, "image/png", PNG + b"\x00" * 5000),
    "/gone.png": (404, "text/plain", b"no"),
}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/slow.png":  # the head, then the body slower than any bound here
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            try:
                for _ in range(50):
                    self.wfile.write(b"\x00")
                    self.wfile.flush()
                    time.sleep(0.1)
            except OSError:  # (the client gave up, as it should)
                pass
            return
        if self.path == "/moved.png":
            self.send_response(302)
            self.send_header("Location", "/cat.png")
            self.end_headers()
            return
        status, kind, body = ROUTES[self.path]
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


ON = Settings(image_fetch=True, image_max_bytes=1000, image_fetch_timeout_s=0.5)


async def test_off_by_default_it_is_a_400_that_says_so(server: str) -> None:
    with pytest.raises(InvalidRequest) as err:
        await fetch(Settings(), Remote(f"{server}/cat.png"), "messages[0].content[0]")
    assert err.value.code == "image_url_not_allowed"
    assert err.value.param == "messages[0].content[0]"
    assert "data URLs only" in err.value.message


async def test_allowed_an_image_is_fetched_and_checked(server: str) -> None:
    assert await fetch(ON, Remote(f"{server}/cat.png"), "p") == PNG
    assert await fetch(ON, Remote(f"{server}/untyped.png"), "p") == PNG  # (judged by its bytes)
    assert await fetch(ON, Remote(f"{server}/moved.png"), "p") == PNG


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("/big.png", "image_too_large"),
        ("/gone.png", "image_fetch_failed"),
        ("/page.html", "unsupported_image_type"),
        ("/typed-wrong.png", "invalid_image"),
        ("/slow.png", "image_fetch_timeout"),
    ],
)
async def test_what_cannot_be_fetched_within_the_bounds_is_refused(
    server: str, path: str, code: str
) -> None:
    with pytest.raises(ImageRefused) as err:
        await fetch(ON, Remote(f"{server}{path}"), "p")
    assert err.value.code == code


async def test_a_server_that_is_not_there_is_refused(server: str) -> None:
    with pytest.raises(ImageRefused) as err:
        await fetch(ON, Remote("http://127.0.0.1:9/cat.png"), "p")
    assert err.value.code == "image_fetch_failed"
