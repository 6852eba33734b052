"""Server-sent events framing.

Two framings (``Framing``): ``resumable`` (the default) carries each event's position as
its ``id:`` line and opens with a ``retry:`` hint, what ``EventSource`` and the SSE
clients of the OpenAI SDKs resume from; ``openai`` is byte for byte OpenAI's own framing
(``data:`` lines only, plus ``event:`` on a Responses stream) for clients that parse it
literally (``vllm bench serve``), the position carried inside each chunk's JSON instead
(``event_id``; a Responses event has its ``sequence_number``).

Every payload is JSON (or the ``[DONE]`` sentinel) whose encoder escapes CR,
LF and NUL; we additionally escape U+2028, U+2029 and U+0085, which some line
splitters (``str.splitlines``, older JS) treat as line ends. ``id:`` and
``event:`` values have CR, LF and NUL removed, so nothing a model writes or a
client sends can create, split or forge an event.
"""

from __future__ import annotations

HEADERS: dict[str, str] = {
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer this response
    "Connection": "keep-alive",
}
MEDIA_TYPE = "text/event-stream"

_UNSAFE_IN_JSON = (
    (b"\xe2\x80\xa8", b"\\u2028"),
    (b"\xe2\x80\xa9", b"\\u2029"),
    (b"\xc2\x85", b"\\u0085"),
)
_FIELD_STRIP = str.maketrans("", "", "\r\n\x00")

# A comment *line*, not followed by a blank line. The SSE spec ignores both forms,
# but the openai Python SDK dispatches an empty event on any blank line once it
# has seen an ``id:`` and then fails to JSON-decode it; a lone comment line keeps
# proxies and load balancers from timing the connection out without that.
KEEPALIVE = b": ping\n"
DONE = b"[DONE]"


def escape_json(payload: bytes) -> bytes:
    """Escape the line separators that valid JSON may carry raw inside strings."""
    if b"\xe2\x80" in payload or b"\xc2\x85" in payload:
        for raw, escaped in _UNSAFE_IN_JSON:
            payload = payload.replace(raw, escaped)
    return payload


def clean_field(value: str) -> str:
    return value.translate(_FIELD_STRIP)


def frame(data: bytes, event_id: str | None = None, event: str | None = None) -> bytes:
    """One SSE event. ``data`` must be a single line (JSON or ``[DONE]``)."""
    if b"\n" in data or b"\r" in data:
        raise ValueError("SSE data must be a single line; encode it as JSON first")
    # data before id: a client that takes the id when it parses the line (rather than
    # when the event is dispatched, as the standard says) would otherwise hold the id of
    # an event it never got when the connection breaks inside the data line, and resume
    # after it. Written this way, the id arrives last, in the same frame as the blank
    # line that completes the event: a cut anywhere before that loses the whole event,
    # id included, and the resume sends it again.
    parts: list[bytes] = []
    if event is not None:
        parts.append(b"event: " + clean_field(event).encode() + b"\n")
    parts.append(b"data: " + escape_json(data) + b"\n")
    if event_id is not None:
        parts.append(b"id: " + clean_field(event_id).encode() + b"\n")
    parts.append(b"\n")
    return b"".join(parts)


def retry(ms: int) -> bytes:
    """Tell the client how long to wait before it reconnects (a field of its own event:
    on its own it dispatches nothing)."""
    return b"retry: " + str(int(ms)).encode() + b"\n\n"


def retry_line(ms: int) -> bytes:
    """The same hint as the first line of a stream (the next event's blank line ends it;
    no blank line of its own, so no client sees an empty event)."""
    return b"retry: " + str(int(ms)).encode() + b"\n"


def with_event_id(data: bytes, event_id: str) -> bytes:
    """A chunk's JSON object with ``"event_id"`` as its first member (the bytes after it
    unchanged); the ``[DONE]`` sentinel as it is."""
    if not data.startswith(b"{") or data == b"{}":
        return data
    return b'{"event_id":"' + clean_field(event_id).replace('"', "").encode() + b'",' + data[1:]


class Framing:
    """How a stream frames its events (see the module's docstring)."""

    def __init__(self, name: str, ids: bool) -> None:
        self.name, self.ids = name, ids

    def __repr__(self) -> str:
        return f"Framing({self.name})"

    def opening(self, hint_ms: int) -> bytes:
        """What a stream starts with: the reconnect hint, where the framing has one."""
        return retry_line(hint_ms) if self.ids else b""

    def keepalive(self) -> bytes:
        """A comment while nothing comes. Without ids it is a message of its own (a
        literal parser splits at blank lines and skips what starts with ``:``; glued to the
        next event it would skip that event too)."""
        return KEEPALIVE if self.ids else b": ping\n\n"

    def reconnect(self, hint_ms: int) -> bytes:
        """The last bytes of a stream whose process drains (then it closes)."""
        return retry(hint_ms) if self.ids else b""

    def chunk(self, data: bytes, event_id: str) -> bytes:
        """A chat or completion chunk at position ``event_id``."""
        if self.ids:
            return frame(data, event_id)
        return frame(with_event_id(data, event_id))

    def event(self, data: bytes, sequence_number: int, event: str) -> bytes:
        """A Responses event (its JSON carries its ``sequence_number``)."""
        return frame(data, str(sequence_number) if self.ids else None, event)


RESUMABLE = Framing("resumable", ids=True)
OPENAI = Framing("openai", ids=False)
FRAMINGS = {f.name: f for f in (RESUMABLE, OPENAI)}
