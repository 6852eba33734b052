"""What a browser loads from the API's origin: the files under service/api/static/ (the
playground, the JS client, the operators' console), served as they are (no build step, a
known media type each, nothing outside the folder), and the OpenAPI spec under /schema.

Every one of them carries the same page headers, set here and nowhere else (issue 41):
a strict Content-Security-Policy (scripts, styles and connections of the page's own
origin only, no inline script or style, no framing, no form posts), ``X-Frame-Options``,
``X-Content-Type-Options: nosniff`` and no referrer. The pages show text that attackers
write (prompts, answers, metadata): a script injected into one must not run, and a page
must not be framed to click on an operator's behalf.

/schema serves the spec only (``openapi.json``, ``openapi.yaml``; /schema itself is the
JSON), no HTML UI: Litestar's UIs load unpinned scripts from a CDN, which would run with
the API's origin (its keys in a playground tab, its console), and vendoring one means
shipping and updating megabytes of someone else's JavaScript. Any OpenAPI viewer reads
the spec from its own origin."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from litestar import Response, Router
from litestar.exceptions import NotFoundException
from litestar.openapi import OpenAPIConfig
from litestar.openapi.plugins import JsonRenderPlugin, YamlRenderPlugin

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


def content_security_policy(connect_src: str = "'self'") -> str:
    return "; ".join(
        (
            "default-src 'none'",
            "script-src 'self'",
            "style-src 'self'",
            f"connect-src {connect_src}",
            "img-src 'self' data:",
            "base-uri 'none'",
            "form-action 'none'",
            "frame-ancestors 'none'",
        )
    )


def page_headers(connect_src: str = "'self'") -> dict[str, str]:
    return {
        "Content-Security-Policy": content_security_policy(connect_src),
        "X-Frame-Options": "DENY",
        "X-Content-Type-Options": "nosniff",
        "Referrer-Policy": "no-referrer",
        # the pages and the client change with the server: a browser asks again, cheaply
        "Cache-Control": "no-cache",
    }


HEADERS = page_headers()
# The playground talks to the server typed into its "Server" field, which may be another
# origin (it never sends a key there unless the user typed it for that server; see
# playground.js): its connections may go to any http(s) origin, nothing else is relaxed.
PLAYGROUND_HEADERS = page_headers("'self' http: https:")
_PER_FILE = {"playground.html": PLAYGROUND_HEADERS}
_FILES = {p.name: p for p in STATIC.iterdir() if p.is_file()}  # what may be served


def static_file(name: str) -> Response[bytes]:
    """The file ``name`` of the static folder (404 for anything else), with the page
    headers (the 404 too)."""
    # looked up among the folder's files, never handed to the filesystem: a name with a
    # NUL byte or of 300 bytes is a 404 like any other, not an error of the OS (a 500)
    path = _FILES.get(name)
    media_type = None if path is None else _TYPES.get(path.suffix)
    if path is None or media_type is None:
        raise NotFoundException(f"no static file {name[:100]!r}", headers=HEADERS)
    headers: Mapping[str, str] = _PER_FILE.get(path.name, HEADERS)
    return Response(path.read_bytes(), media_type=media_type, headers=headers)


def openapi_config(title: str, version: str) -> OpenAPIConfig:
    """The spec at /schema (JSON, also at /schema/openapi.json) and /schema/openapi.yaml,
    with the page headers; no HTML UI (see above)."""
    router = Router("/schema", route_handlers=[], include_in_schema=False, response_headers=HEADERS)
    return OpenAPIConfig(
        title=title,
        version=version,
        path="/schema",
        render_plugins=[JsonRenderPlugin(), YamlRenderPlugin()],
        openapi_router=router,
    )
