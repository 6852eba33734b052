"""Log events -> OpenAI objects.

The log stores compact events; this module renders them as OpenAI
``chat.completion.chunk`` / ``text_completion`` SSE payloads, or aggregates a
whole log into a non-streaming response. Rendering is a pure function of the
``Created`` event and the event at hand, so any reader, at any time, on any
replica, renders the same bytes: resume and replay are exact.
"""

from __future__ import annotations

from typing import Any

import msgspec

from service.stream import sse
from service.stream.events import Created, Delta, End, Error, Event, Kind
from service.stream.ids import Cursor, EventId, frame_ids, frames_to_skip
from service.stream.sse import DONE

_json = msgspec.json.Encoder()


def usage(end: End) -> dict[str, int]:
    return {
        "prompt_tokens": end.prompt_tokens,
        "completion_tokens": end.completion_tokens,
        "total_tokens": end.prompt_tokens + end.completion_tokens,
    }


def error_object(err: Error) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": "server_error", "code": err.code}}


class ChunkRenderer:
    """Renders one request's events as SSE payloads (JSON bytes, or ``[DONE]``)."""

    def __init__(self, request_id: str, created: Created) -> None:
        self.request_id = request_id
        self.created = created
        self.chat = created.kind == Kind.CHAT

    def render(self, event: Event) -> list[bytes]:
        if isinstance(event, Created):
            return [self._chunk({"role": "assistant", "content": ""})] if self.chat else []
        if isinstance(event, Delta):
            return [self._chunk({"content": event.text}, text=event.text)]
        if isinstance(event, Error):
            return [_json.encode(error_object(event))]
        if isinstance(event, End):
            return self._end(event)
        raise TypeError(f"unknown event {event!r}")

    def _end(self, end: End) -> list[bytes]:
        if end.finish_reason is None:
            # errored: the error event already told the client; no [DONE] after an error
            return []
        frames = [self._chunk({}, text="", finish_reason=end.finish_reason)]
        if self.created.include_usage:
            frames.append(_json.encode({**self._head(), "choices": [], "usage": usage(end)}))
        frames.append(DONE)
        return frames

    def _head(self) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created.created,
            "model": self.created.model,
        }

    def _chunk(
        self, delta: dict[str, Any], *, text: str = "", finish_reason: str | None = None
    ) -> bytes:
        if self.chat:
            choice: dict[str, Any] = {"index": 0, "delta": delta}
        else:
            choice = {"index": 0, "text": text}
        choice["logprobs"] = None
        choice["finish_reason"] = finish_reason
        return _json.encode({**self._head(), "choices": [choice]})


class ResponseAggregate:
    """Collects a whole log into one non-streaming OpenAI response."""

    def __init__(self, request_id: str, created: Created) -> None:
        self.request_id = request_id
        self.created = created
        self.parts: list[str] = []
        self.end: End | None = None
        self.error: Error | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, Delta):
            self.parts.append(event.text)
        elif isinstance(event, Error):
            self.error = event
        elif isinstance(event, End):
            self.end = event

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def response(self) -> dict[str, Any]:
        if self.end is None:
            raise RuntimeError("the request has not ended")
        chat = self.created.kind == Kind.CHAT
        if chat:
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": self.text},
            }
        else:
            choice = {"index": 0, "text": self.text}
        choice["logprobs"] = None
        choice["finish_reason"] = self.end.finish_reason
        return {
            "id": self.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": self.created.created,
            "model": self.created.model,
            "choices": [choice],
            "usage": usage(self.end),
        }


def sse_event_frames(
    renderer: ChunkRenderer, event_id: EventId, event: Event, cursor: Cursor | None
) -> list[bytes]:
    """One log event as the SSE bytes a reader at ``cursor`` has not seen yet."""
    skip = frames_to_skip(cursor, event_id)
    if skip is None:
        return []
    payloads = renderer.render(event)
    ids = frame_ids(event_id, len(payloads))
    return [sse.frame(p, str(i)) for p, i in zip(payloads, ids, strict=True)][skip:]


def coalesce(batch: list[tuple[EventId, Event]]) -> list[tuple[EventId, Event]]:
    """Merge runs of consecutive deltas into one delta carrying the last one's id.

    For a reader that fell behind: fewer, larger SSE events with the same text, and the
    ids stay valid cursors (resuming after a merged event continues after its last part).
    """
    out: list[tuple[EventId, Event]] = []
    for eid, event in batch:
        if out and isinstance(event, Delta) and isinstance(out[-1][1], Delta):
            prev = out[-1][1]
            assert isinstance(prev, Delta)
            merged = Delta(
                text=prev.text + event.text, token_ids=prev.token_ids + event.token_ids, n=event.n
            )
            out[-1] = (eid, merged)
        else:
            out.append((eid, event))
    return out
