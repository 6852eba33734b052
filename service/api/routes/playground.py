"""The playground page (/playground) and the static files it uses (/static/...): the JS
client (lastevent.js) and the page itself, served as they are in service/api/static/ (no
build step, no API key needed to load them)."""

from __future__ import annotations

from pathlib import Path

from litestar import Controller, Response, get
from litestar.exceptions import NotFoundException

STATIC = Path(__file__).resolve().parents[1] / "static"
_TYPES = {
    ".js": "text/javascript; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".png": "image/png",
    ".svg": "image/svg+xml",
}
# the page and the client change with the server: a browser asks again each time, cheaply
_HEADERS = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}


def _file(name: str) -> Response[bytes]:
    path = (STATIC / name).resolve()
    media_type = _TYPES.get(path.suffix)
    if media_type is None or path.parent != STATIC or not path.is_file():
        raise NotFoundException(f"no static file {name!r}")
    return Response(path.read_bytes(), media_type=media_type, headers=_HEADERS)


class PlaygroundController(Controller):
    tags = ("playground",)
    include_in_schema = False

    @get("/playground", summary="A chat page that streams through the JS client")
    async def playground(self) -> Response[bytes]:
        return _file("playground.html")

    @get("/static/{name:str}", summary="The JS client and the playground's files")
    async def static(self, name: str) -> Response[bytes]:
        return _file(name)
