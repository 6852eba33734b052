"""Per-request routes: status and the resumable event stream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.openapi.datastructures import ResponseSpec
from litestar.response import Stream

from service.api import intake
from service.api.auth import Principal
from service.api.cancel import cancel_request
from service.api.context import Context
from service.api.documented import EVENT_CURSOR, SSE, success_as
from service.api.framing import framing
from service.api.metrics import RESUMES
from service.api.readers import admit_return, seated, sse_frames
from service.api.request_ids import REQUEST_ID_HEADER, checked_request_id, no_such_request
from service.api.schemas import error_responses
from service.api.status import request_status
from service.stream import resume, sse
from service.stream.events import Created, Event
from service.stream.ids import Cursor, EventId
from service.stream.lifecycle import State
from service.stream.render import ChunkRenderer, sse_event_frames


class RequestsController(Controller):
    path = "/v1/requests"
    tags = ("requests",)

    @get(
        "/{request_id:str}/events",
        summary="Stream a request's events (resumable)",
        operation_class=success_as(SSE, json=False, headers=(EVENT_CURSOR,)),
        responses={
            **error_responses(400, 401, 404),
            204: ResponseSpec(None, description="The cursor is the terminal event"),
        },
        opt={"stream_token": True},
    )
    async def events(
        self,
        ctx: Context,
        principal: Principal,
        request: Request[Any, Any, Any],
        request_id: str,
        after: str | None = None,
    ) -> Stream | Response[bytes]:
        """SSE from the start, or after ``Last-Event-ID`` (header) / ``?after=``; 204 when
        the cursor is the terminal event (nothing more will come)."""
        cursor, param = intake.event_cursor(request, after, "after")
        framed = framing(request, ctx.settings.sse_framing)
        # after the cursor's check, as for an id that never existed (same answers)
        checked_request_id(request_id)
        headers = {**sse.HEADERS, REQUEST_ID_HEADER: request_id}
        # first entry, the cursor's entry, last two entries: one round trip (each await is
        # a turn of a busy event loop, and this is the reconnect latency a client feels)
        looked = await ctx.log.look(request_id, cursor.event if cursor else None)
        entries: list[tuple[EventId, Event]] = []
        if not isinstance(looked.first, Created):  # the hot log is gone: from the archive
            if ctx.ledger is not None:
                entries = await ctx.ledger.archived(request_id) or []
            looked = resume.Looked.whole(entries, cursor)
        plan = resume.event_plan(request_id, principal.tenant, looked, cursor)
        if looked.hot and cursor is not None and not isinstance(plan, resume.NotYours):
            RESUMES.inc()
        match plan:
            case resume.NotYours():
                raise no_such_request(request_id)
            case resume.UnknownCursor(cursor=foreign):
                raise intake.foreign_cursor(foreign, request_id, param)
            case resume.NothingToSend():
                # the client has it all: 204 is how the SSE standard tells it to stop (an
                # empty 200 makes EventSource reconnect every few seconds, for ever)
                return Response(b"", status_code=204, headers={REQUEST_ID_HEADER: request_id})
            case resume.FromArchive():
                hint = ctx.settings.reconnect_hint_ms
                frames = cold_frames(request_id, entries, plan.cursor, hint, framed)
                return Stream(frames, media_type=sse.MEDIA_TYPE, headers=headers)
        live = sse_frames(ctx, request_id, plan.created, plan.cursor, framing=framed)
        frames = seated(ctx, request_id, plan.created, live)
        await admit_return(ctx, request_id, plan.created)
        return Stream(frames, media_type=sse.MEDIA_TYPE, headers=headers)

    @get(
        "/{request_id:str}",
        summary="A request's state, finish_reason and usage",
        responses=error_responses(401, 404),
        opt={"stream_token": True},
    )
    async def status(self, ctx: Context, principal: Principal, request_id: str) -> dict[str, Any]:
        found = await request_status(ctx, checked_request_id(request_id))
        if found is None or found.pop("tenant") != principal.tenant:
            raise no_such_request(request_id)
        return found

    @post(
        "/{request_id:str}/cancel",
        status_code=200,
        summary="Cancel a request in any phase (idempotent)",
        responses={
            **error_responses(401, 404),
            202: ResponseSpec(
                dict[str, Any], description="Not confirmed yet by its worker: its state"
            ),
        },
    )
    async def cancel(
        self, ctx: Context, principal: Principal, request_id: str
    ) -> Response[dict[str, Any]]:
        """Queued: ended here, no engine sees it. Running: its worker aborts it at the next
        engine step. Already ended: nothing changes. Answers the request's state: 200 once
        it is terminal, 202 if the worker has not confirmed within ``cancel_wait_s``."""
        found = await cancel_request(ctx, principal, request_id)
        return Response(found, status_code=200 if State(found["state"]).terminal else 202)


async def cold_frames(
    rid: str,
    entries: list[tuple[EventId, Event]],
    cursor: Cursor | None,
    reconnect_hint_ms: int,
    framed: sse.Framing,
) -> AsyncIterator[bytes]:
    """An archived log as SSE (``framed`` so): the same ids and bytes the hot log gave."""
    created = entries[0][1]
    assert isinstance(created, Created)
    renderer = ChunkRenderer(rid, created)
    out: list[bytes] = [framed.opening(reconnect_hint_ms)]
    for eid, event in entries:
        out.extend(sse_event_frames(renderer, eid, event, cursor, framed))
    if out:
        yield b"".join(out)
