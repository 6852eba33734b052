"""Which SSE framing a stream gets (``sse.Framing``): the request's ``X-SSE-Framing``
header or ``?sse_framing=`` query parameter, else the deployment's ``sse_framing``.

``resumable`` is the default because resuming is what lastevent is for: ``EventSource``,
fetch-event-source, httpx-sse and both OpenAI SDKs read ``id:`` and ``retry:`` as the SSE
standard says. ``openai`` is for clients that parse OpenAI's framing literally (every
blank-line-separated message taken as ``data: <json>``): they resume from the
``event_id`` inside each chunk (a Responses event's ``sequence_number``), sent back as
``Last-Event-ID`` or ``?after=`` / ``starting_after``.
"""

from __future__ import annotations

from typing import Any

from litestar import Request

from service.errors import InvalidRequest
from service.stream import sse

HEADER = "X-SSE-Framing"
QUERY = "sse_framing"


def framing(request: Request[Any, Any, Any], default: str) -> sse.Framing:
    """The framing ``request`` asks for (a 400 naming the choices for another value)."""
    asked = request.headers.get(HEADER) or request.query_params.get(QUERY)
    name = (asked or default).strip().lower()
    found = sse.FRAMINGS.get(name)
    if found is None:
        param = HEADER if request.headers.get(HEADER) else QUERY
        choices = " or ".join(sorted(sse.FRAMINGS))
        raise InvalidRequest(f"{param} is {choices}, not {name!r}", param=param)
    return found
