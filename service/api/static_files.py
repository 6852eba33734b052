"""The files under service/api/static/ (the playground, the JS client, the operators'
console), served as they are: no build step, a known media type each, nothing outside
the folder."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from litestar import Response
from litestar.exceptions import NotFoundException

STATIC = Path(__file__).resolve().parent / "static"
# (Litestar adds "; charset=utf-8" to a text type itself: it was there twice)
_TYPES = {
    ".js": "text/javascript",
    ".mjs": "text/javascript",
    ".html": "text/html",
    ".css": "text/css",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}
# the pages and the client change with the server: a browser asks again each time, cheaply
HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def static_file(name: str, headers: Mapping[str, str] | None = None) -> Response[bytes]:
    """The file ``name`` of the static folder (404 for anything else), with ``headers``
    added to the usual ones."""
    path = (STATIC / name).resolve()
    media_type = _TYPES.get(path.suffix)
    if media_type is None or path.parent != STATIC or not path.is_file():
        raise NotFoundException(f"no static file {name!r}")
    return Response(
        path.read_bytes(), media_type=media_type, headers={**HEADERS, **(headers or {})}
    )
