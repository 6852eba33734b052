"""The operators' console (/console): a static page (console.html, console.js,
console.css under service/api/static/) over the JSON routes of /v1/admin. Loading it
needs no key; the page asks for one and keeps it in the tab's sessionStorage only.

The page shows attacker-controlled text (prompts, answers, metadata), so it is served
with a strict Content-Security-Policy: scripts, styles and connections of its own origin
only, no inline script or style, no framing, no form posts, no referrer (the page headers
of every static file, set in static_files.py)."""

from __future__ import annotations

from litestar import Controller, Response, get

from service.api.static_files import static_file


class ConsoleController(Controller):
    tags = ("console",)
    include_in_schema = False

    @get("/console", summary="The operators' console: find, open, replay and reconcile requests")
    async def console(self) -> Response[bytes]:
        return static_file("console.html")
