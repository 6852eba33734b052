"""Log events -> OpenAI objects.

The log stores compact events; this module renders them as OpenAI
``chat.completion.chunk`` / ``text_completion`` SSE payloads, or aggregates a
whole log into a non-streaming response. Rendering is a pure function of the
``Created`` event and the event at hand, so any reader, at any time, on any
replica, renders the same bytes: resume and replay are exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgspec

from service.stream import sse
from service.stream.events import Created, Delta, End, Error, Event, Kind
from service.stream.ids import Cursor, EventId, frame_ids, frames_to_skip
from service.stream.logprobs import Logprob, chat_logprobs, completion_logprobs
from service.stream.sse import DONE

_json = msgspec.json.Encoder()


def usage(end: End) -> dict[str, int]:
    return {
        "prompt_tokens": end.prompt_tokens,
        "completion_tokens": end.completion_tokens,
        "total_tokens": end.prompt_tokens + end.completion_tokens,
    }


def error_object(err: Error) -> dict[str, Any]:
    error = {"message": err.message, "type": "server_error", "param": None, "code": err.code}
    return {"error": error}


class ChunkRenderer:
    """Renders one request's events as SSE payloads (JSON bytes, or ``[DONE]``)."""

    def __init__(self, request_id: str, created: Created) -> None:
        self.request_id = request_id
        self.created = created
        self.chat = created.kind == Kind.CHAT

    def render(self, event: Event) -> list[bytes]:
        if isinstance(event, Created):
            if not self.chat:
                return []
            role = {"role": "assistant", "content": ""}
            return [self._chunk(i, role, completion_tokens=0) for i in self._choices()]
        if isinstance(event, Delta):
            return self._delta(event)
        if isinstance(event, Error):
            return [_json.encode(error_object(event))]
        if isinstance(event, End):
            return self._end(event)
        raise TypeError(f"unknown event {event!r}")

    def _choices(self) -> range:
        return range(self.created.n)

    def _delta(self, d: Delta) -> list[bytes]:
        """The text, then each tool-call piece, one chunk each; logprobs on the first."""
        logprobs = None
        if d.logprobs is not None:
            if self.chat:
                logprobs = chat_logprobs(d.logprobs)
            else:
                logprobs = completion_logprobs(d.logprobs, d.offset or 0)
        frames = []
        if d.text or not d.tools:
            content = {"content": d.text}
            frames.append(
                self._chunk(d.index, content, text=d.text, logprobs=logprobs, completion_tokens=d.n)
            )
            logprobs = None
        for piece in d.tools or ():
            call: dict[str, Any] = {"index": piece.call}
            if piece.id is not None:
                call["id"] = piece.id
                call["type"] = "function"
                call["function"] = {"name": piece.name, "arguments": piece.arguments}
            else:
                call["function"] = {"arguments": piece.arguments}
            frames.append(
                self._chunk(
                    d.index, {"tool_calls": [call]}, logprobs=logprobs, completion_tokens=d.n
                )
            )
            logprobs = None
        return frames

    def _end(self, end: End) -> list[bytes]:
        if end.finish_reason is None:
            # errored: the error event already told the client; no [DONE] after an error
            return []
        reasons = end.finish_reasons or [end.finish_reason]
        frames = [
            self._chunk(i, {}, finish_reason=reason, completion_tokens=end.completion_tokens)
            for i, reason in enumerate(reasons)
        ]
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
        self,
        index: int,
        delta: dict[str, Any],
        *,
        text: str = "",
        finish_reason: str | None = None,
        logprobs: dict[str, Any] | None = None,
        completion_tokens: int = 0,
    ) -> bytes:
        """``completion_tokens``: the choice's so far (``continuous_usage``: every chunk
        says the usage; at the end, the request's)."""
        if self.chat:
            choice: dict[str, Any] = {"index": index, "delta": delta}
        else:
            choice = {"index": index, "text": text}
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        chunk = {**self._head(), "choices": [choice]}
        if self.created.continuous_usage:
            prompt = self.created.prompt_tokens
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens,
            }
        return _json.encode(chunk)


@dataclasses.dataclass(slots=True)
class _Choice:
    parts: list[str] = dataclasses.field(default_factory=list)
    calls: dict[int, dict[str, Any]] = dataclasses.field(default_factory=dict)
    logprobs: list[Logprob] | None = None


class ResponseAggregate:
    """Collects a whole log into one non-streaming OpenAI response."""

    def __init__(self, request_id: str, created: Created) -> None:
        self.request_id = request_id
        self.created = created
        self.choices = [_Choice() for _ in range(created.n)]
        self.end: End | None = None
        self.error: Error | None = None

    def add(self, event: Event) -> None:
        if isinstance(event, Delta):
            choice = self.choices[event.index]
            choice.parts.append(event.text)
            if event.logprobs is not None:
                choice.logprobs = (choice.logprobs or []) + event.logprobs
            for piece in event.tools or ():
                call = choice.calls.setdefault(
                    piece.call,
                    {"id": piece.id, "type": "function", "function": {"name": piece.name}},
                )
                fn = call["function"]
                fn["arguments"] = fn.get("arguments", "") + piece.arguments
        elif isinstance(event, Error):
            self.error = event
        elif isinstance(event, End):
            self.end = event

    @property
    def text(self) -> str:
        return "".join(self.choices[0].parts)

    def response(self) -> dict[str, Any]:
        if self.end is None:
            raise RuntimeError("the request has not ended")
        chat = self.created.kind == Kind.CHAT
        reasons = self.end.finish_reasons or [self.end.finish_reason]
        choices = []
        for index, (c, reason) in enumerate(zip(self.choices, reasons, strict=True)):
            text = "".join(c.parts)
            logprobs: dict[str, Any] | None = None
            if chat:
                # refusal: required and nullable (OpenAI's spec); annotations: none here
                message: dict[str, Any] = {
                    "role": "assistant",
                    "content": text,
                    "refusal": None,
                    "annotations": [],
                }
                if c.calls:
                    message["content"] = text or None
                    message["tool_calls"] = [c.calls[k] for k in sorted(c.calls)]
                choice: dict[str, Any] = {"index": index, "message": message}
                if c.logprobs is not None:
                    logprobs = chat_logprobs(c.logprobs)
            else:
                choice = {"index": index, "text": text}
                if c.logprobs is not None:
                    logprobs = completion_logprobs(c.logprobs, 0)
            choice["logprobs"] = logprobs
            choice["finish_reason"] = reason
            choices.append(choice)
        return {
            "id": self.request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": self.created.created,
            "model": self.created.model,
            "choices": choices,
            "usage": usage(self.end),
        }


def sse_event_frames(
    renderer: ChunkRenderer,
    event_id: EventId,
    event: Event,
    cursor: Cursor | None,
    framing: sse.Framing = sse.RESUMABLE,
) -> list[bytes]:
    """One log event as the SSE bytes a reader at ``cursor`` has not seen yet."""
    skip = frames_to_skip(cursor, event_id)
    if skip is None:
        return []
    payloads = renderer.render(event)
    ids = frame_ids(event_id, len(payloads))
    return [framing.chunk(p, str(i)) for p, i in zip(payloads, ids, strict=True)][skip:]


def coalesce(batch: list[tuple[EventId, Event]]) -> list[tuple[EventId, Event]]:
    """Merge runs of consecutive deltas into one delta carrying the last one's id.

    For a reader that fell behind: fewer, larger SSE events with the same text, and the
    ids stay valid cursors (resuming after a merged event continues after its last part).
    """
    out: list[tuple[EventId, Event]] = []
    for eid, event in batch:
        prev = out[-1][1] if out else None
        if isinstance(event, Delta) and isinstance(prev, Delta) and _mergeable(prev, event):
            merged = Delta(
                text=prev.text + event.text,
                token_ids=prev.token_ids + event.token_ids,
                n=event.n,
                index=event.index,
                logprobs=None if prev.logprobs is None else prev.logprobs + (event.logprobs or []),
                offset=prev.offset,
            )
            out[-1] = (eid, merged)
        else:
            out.append((eid, event))
    return out


def _mergeable(a: Delta, b: Delta) -> bool:
    """Two deltas one reader may see as one: same choice, text only (a tool-call piece
    keeps its place), logprobs on both or neither."""
    return (
        a.index == b.index
        and not a.tools
        and not b.tools
        and (a.logprobs is None) == (b.logprobs is None)
    )
