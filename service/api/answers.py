"""What a POST answers once its request is accepted (``submit.Accepted``): the stream,
the whole answer as JSON, or (a background response) the queued response object -- for
a new request and for an idempotent replay alike (a replay's stream starts over, or
after the POST's ``Last-Event-ID``; its reader takes a lease of its own)."""

from __future__ import annotations

import dataclasses
from typing import Any

from litestar import Request, Response
from litestar.response import Stream

from service.api import intake
from service.api.context import Context
from service.api.metrics import REQUESTS
from service.api.readers import (
    collect,
    reader_lease,
    response_collect,
    response_frames,
    response_renderer,
    sse_frames,
    until_disconnect,
)
from service.api.schemas import ResponsesRequest
from service.api.submit import Accepted
from service.errors import ApiError
from service.store.readers import Lease
from service.stream import resume, sse
from service.stream.lifecycle import State
from service.stream.render import error_object

CLIENT_GONE = 499  # nginx's "client closed request": nobody reads this answer


async def completion(
    ctx: Context,
    request: Request[Any, Any, Any],
    acc: Accepted,
    *,
    stream: bool,
    kind: str,
    framed: sse.Framing = sse.RESUMABLE,
) -> Response[Any] | Stream:
    """A chat or text completion: SSE chunks (``framed`` so), or the whole answer."""
    if not acc.replayed:
        REQUESTS.labels(kind=kind, stream=str(stream).lower(), model=acc.created.model).inc()
    rid, created = acc.request_id, acc.created
    if not stream:
        agg = await until_disconnect(request, collect(ctx, rid, created, await _lease(ctx, acc)))
        if agg is None:  # the client went away; its lease is released, the grace period runs
            return Response(b"", status_code=CLIENT_GONE, headers=acc.headers)
        if agg.end is not None and agg.end.state == State.ERRORED:
            err = agg.error
            content = error_object(err) if err else ApiError("the request failed").body()
            if err is not None and err.code == "log_lost":  # nothing ran to its end: send again
                headers = {**acc.headers, "Retry-After": "1"}
                return Response(content, status_code=503, headers=headers)
            return Response(content, status_code=500, headers=acc.headers)
        return Response(agg.response(), headers=acc.headers)
    cursor, param = intake.event_cursor(request) if acc.replayed else (None, "after")
    looked = resume.Looked(created)  # (found by the caller's key: its tenant's)
    if cursor is not None:  # a replay, after the retried POST's Last-Event-ID
        looked = dataclasses.replace(await ctx.log.look(rid, cursor.event), first=created)
    match resume.event_plan(rid, created.tenant, looked, cursor):
        case resume.UnknownCursor(cursor=foreign):
            raise intake.foreign_cursor(foreign, rid, param)
        case resume.NothingToSend():  # it has it all: stop
            return Response(b"", status_code=204, headers=acc.headers)
    frames = sse_frames(ctx, rid, created, cursor, lease=acc.lease, framing=framed)
    return Stream(frames, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **acc.headers})


async def response(
    ctx: Context,
    request: Request[Any, Any, Any],
    acc: Accepted,
    body: ResponsesRequest,
    framed: sse.Framing = sse.RESUMABLE,
) -> Response[Any] | Stream:
    """A response: its events, its object once it ended, or -- in background mode -- its
    object at once (queued, or as far as it got for a replay)."""
    if not acc.replayed:
        model = acc.created.model
        REQUESTS.labels(kind="response", stream=str(body.stream).lower(), model=model).inc()
    rid, created = acc.request_id, acc.created
    if body.stream:
        after = intake.sequence_cursor(request) if acc.replayed else None
        plan = resume.sequence_plan(created.tenant, resume.Looked(created), after)
        assert isinstance(plan, resume.FromHotLog)  # (its key found it; read hot)
        frames = response_frames(ctx, rid, created, plan.cursor, lease=acc.lease, framing=framed)
        return Stream(frames, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **acc.headers})
    if body.background:  # answered at once: it runs with no reader
        renderer = response_renderer(rid, created)
        if acc.lease is not None:  # new: queued
            await acc.lease.release()
            renderer.feed(created)
        else:  # a replay: as far as it got
            for _, event in await ctx.log.read(rid):
                renderer.feed(event)
        return Response(renderer.response_object(), headers=acc.headers)
    lease = await _lease(ctx, acc)
    done = await until_disconnect(request, response_collect(ctx, rid, created, lease))
    if done is None:  # the client went away; the grace period runs
        return Response(b"", status_code=CLIENT_GONE, headers=acc.headers)
    return Response(done.response_object(), headers=acc.headers)


async def _lease(ctx: Context, acc: Accepted) -> Lease:
    """The reader's lease: the one taken with the request, or a replay's own."""
    if acc.lease is not None:
        return acc.lease
    return await reader_lease(ctx, acc.request_id, acc.created)
