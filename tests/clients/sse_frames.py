"""An SSE response read frame by frame, as bytes: what test_nginx.py compares with a full
read. A frame is what comes before a blank line; an event's bytes are its lines but
comments (``: ping``) and ``retry:``, so the same event read on any connection is the
same bytes."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator

import httpx


def frames(r: httpx.Response) -> Iterator[tuple[str, bytes]]:
    """What ``r`` sends, as it arrives: ``("ping", b"")`` for each comment line (a ``:
    ping`` is a line, not an event: it may share a blank line with the next event),
    ``("retry", b"")`` for a ``retry:`` line, ``("event", bytes)`` for each event."""
    buf = b""
    for chunk in r.iter_bytes():
        buf += chunk
        *whole, buf = buf.split(b"\n\n")
        for frame in whole:
            lines = frame.split(b"\n")
            for line in lines:
                if line.startswith(b":"):
                    yield "ping", b""
                elif line.startswith(b"retry:"):
                    yield "retry", b""
            kept = [x for x in lines if not x.startswith((b":", b"retry:"))]
            if kept:
                yield "event", b"\n".join(kept)


def event_frames(r: httpx.Response) -> Iterator[bytes]:
    """The events of ``r``, as bytes."""
    return (frame for kind, frame in frames(r) if kind == "event")


def frame_id(frame: bytes) -> str:
    """The event's id (its ``id:`` line)."""
    ids = [x[4:].decode() for x in frame.split(b"\n") if x.startswith(b"id: ")]
    assert ids, frame
    return ids[-1]


def text_of(events: Iterable[bytes]) -> str:
    """The answer's text: every choice's delta content, in order."""
    out = []
    for frame in events:
        for line in frame.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                for choice in json.loads(line[6:]).get("choices", []):
                    out.append((choice.get("delta") or {}).get("content") or "")
    return "".join(out)


def read_some(r: httpx.Response, into: list[bytes], n: int) -> bool:
    """Up to ``n`` more events of ``r`` into ``into``; True at the stream's end."""
    for i, frame in enumerate(event_frames(r), 1):
        into.append(frame)
        if frame.startswith(b"data: [DONE]"):
            return True
        if i == n:
            break
    return False
