"""The playground page (/playground) and the static files (/static/...): the JS client
(lastevent.js), the playground's script and style and the console's files, served as they
are in service/api/static/ (no build step, no API key needed to load them), each with the
page headers of static_files.py. Where the playground may send a key: playground.js."""

from __future__ import annotations

from litestar import Controller, Response, get

from service.api.static_files import STATIC, static_file

__all__ = ["STATIC", "PlaygroundController"]  # STATIC: the folder, for tests


class PlaygroundController(Controller):
    tags = ("playground",)
    include_in_schema = False

    @get("/playground", summary="A chat page that streams through the JS client")
    async def playground(self) -> Response[bytes]:
        return static_file("playground.html")

    @get("/static/{name:str}", summary="The JS client and the playground's files")
    async def static(self, name: str) -> Response[bytes]:
        return static_file(name)
