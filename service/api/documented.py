"""What the OpenAPI schema says of a route where Litestar cannot read it from the
handler's signature: a 200 that is a stream (server-sent events, a text or NDJSON
replay) instead of, or beside, JSON; and the headers the route reads from the request
itself (``Last-Event-ID``, ``Idempotency-Key``).

A route names it with ``operation_class=success_as(...)``; schemathesis
(``tests/e2e/test_schema.py``) holds every answer to the schema, and sends those
headers too."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from litestar.openapi.spec import (
    OpenAPIMediaType,
    OpenAPIResponse,
    OpenAPIType,
    Operation,
    Parameter,
    Schema,
)

from service.stream import sse

SSE = sse.MEDIA_TYPE
# (OpenAPI before 3.2: an event stream's ``schema`` describes one event)
_EVENT = Schema(
    type=OpenAPIType.OBJECT,
    properties={
        "data": Schema(type=OpenAPIType.STRING),
        "event": Schema(type=OpenAPIType.STRING),
        "id": Schema(type=OpenAPIType.STRING),
        "retry": Schema(type=OpenAPIType.INTEGER),
    },
)


def _header(name: str, description: str) -> Parameter:
    """(Any text: what is not a valid one is a 400 naming it, which the schema cannot say
    exactly -- the header is trimmed, a cursor must belong to the request.)"""
    text = Schema(type=OpenAPIType.STRING)
    return Parameter(name=name, param_in="header", schema=text, description=description)


IDEMPOTENCY_KEY = _header(
    "Idempotency-Key",
    "1-255 printable ASCII characters: the same key and body again answer the same "
    "request (its stream from the start, or after Last-Event-ID); another body, a 422",
)
EVENT_CURSOR = _header(
    "Last-Event-ID", "Resume after this event id (<ms>-<seq>[:<frame>]); wins over ?after="
)
SEQUENCE_CURSOR = _header(
    "Last-Event-ID", "Resume after this sequence number; wins over ?starting_after="
)


def success_as(*media_types: str, json: bool, headers: Sequence[Parameter] = ()) -> type[Operation]:
    """An operation whose 200 is each of ``media_types`` -- and JSON as the signature
    documents it, if ``json`` -- and which reads ``headers``."""

    @dataclass
    class Answers(Operation):
        def __post_init__(self) -> None:
            if headers:
                self.parameters = [*(self.parameters or []), *headers]
            ok = (self.responses or {}).get("200")
            if not isinstance(ok, OpenAPIResponse):
                return
            kept = {k: v for k, v in (ok.content or {}).items() if json and "json" in k}
            ok.content = {**kept, **{m: _described(m) for m in media_types}}

    return Answers


def _described(media_type: str) -> OpenAPIMediaType:
    """An event of a stream; the text of anything else (NDJSON: lines of JSON)."""
    return OpenAPIMediaType(schema=_EVENT if media_type == SSE else Schema(type=OpenAPIType.STRING))
