"""Per-request routes: status and the resumable event stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from litestar import Controller, Request, get
from litestar.response import Stream

from service.api.completions import REQUEST_ID_HEADER
from service.errors import InvalidRequest, NotFound
from service.metrics import RESUMES
from service.requests import Context, sse_frames
from service.stream import sse
from service.stream.events import End
from service.stream.ids import Cursor, InvalidEventId
from service.stream.render import usage


def _cursor(raw: str | None, param: str) -> Cursor | None:
    if raw is None or raw == "":
        return None
    try:
        return Cursor.parse(raw)
    except InvalidEventId as exc:
        raise InvalidRequest(str(exc), param=param, code="invalid_event_id") from None


async def _nothing() -> AsyncIterator[bytes]:
    return
    yield b""


class RequestsController(Controller):
    path = "/v1/requests"
    tags = ["requests"]

    @get("/{request_id:str}/events", summary="Stream a request's events (resumable)")
    async def events(
        self, ctx: Context, request: Request[Any, Any, Any], request_id: str, after: str | None = None
    ) -> Stream:
        """SSE from the start, or after ``Last-Event-ID`` (header) / ``?after=``."""
        header = request.headers.get("last-event-id")
        cursor = _cursor(header, "Last-Event-ID") if header else _cursor(after, "after")
        created = await ctx.log.first(request_id)
        if created is None:
            raise NotFound(f"no request '{request_id}'", param="request_id", code="not_found")
        frames = sse_frames(ctx, request_id, created, cursor)
        if cursor is not None:
            RESUMES.inc()
            if not await ctx.log.has_event(request_id, cursor.event):
                raise InvalidRequest(
                    f"event id '{cursor}' is not an event of request '{request_id}'",
                    param="Last-Event-ID" if header else "after",
                    code="invalid_event_id",
                )
            last = await ctx.log.last(request_id)
            if last is not None and isinstance(last[1], End) and cursor.event == last[0]:
                if cursor.frame is None:  # the client has everything: an empty, closed stream
                    frames = _nothing()
        return Stream(
            frames,
            media_type=sse.MEDIA_TYPE,
            headers={**sse.HEADERS, REQUEST_ID_HEADER: request_id},
        )

    @get("/{request_id:str}", summary="A request's state, finish_reason and usage")
    async def status(self, ctx: Context, request_id: str) -> dict[str, Any]:
        meta = await ctx.log.meta(request_id)
        if meta is not None:
            last = await ctx.log.last(request_id)
            created = await ctx.log.first(request_id)
            out: dict[str, Any] = {
                "id": request_id,
                "object": "request",
                "state": meta.state,
                "model": created.model if created else None,
                "created": created.created if created else None,
                "finish_reason": None,
                "usage": None,
                "last_event_id": meta.last_event_id,
            }
            if last is not None and isinstance(last[1], End):
                out["finish_reason"] = last[1].finish_reason
                out["usage"] = usage(last[1])
            return out
        row = await ctx.ledger.get(request_id) if ctx.ledger is not None else None
        if row is None:
            raise NotFound(f"no request '{request_id}'", param="request_id", code="not_found")
        return {
            "id": row.id,
            "object": "request",
            "state": row.state,
            "model": row.model,
            "created": int(row.created_at.timestamp()),
            "finish_reason": row.finish_reason,
            "usage": {
                "prompt_tokens": row.prompt_tokens,
                "completion_tokens": row.completion_tokens,
                "total_tokens": row.total_tokens,
            },
            "last_event_id": row.last_event_id,
        }
