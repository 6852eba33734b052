"""OpenAI's Responses API over the same request log: ``POST /v1/responses`` (streaming,
not, or ``background``), ``GET /v1/responses/{id}`` (the object, or its events after
``starting_after`` / ``Last-Event-ID``), ``POST /v1/responses/{id}/cancel``,
``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``;
``POST /v1/responses/compact`` (the conversation summarised: ``compaction.py``).

A response is a request like a chat completion (the same prompt, tools, structured
output, worker and log); only its rendering differs (``stream/response_events.py``),
and it counts its events from the log's start, so a stream resumed on any replica, or
read back from the archive, has the same sequence numbers and bytes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from litestar import Controller, Request, Response, delete, get, post
from litestar.response import Stream

from service.api import answers, intake
from service.api.auth import Principal
from service.api.cancel import cancel_request
from service.api.compaction import CompactRequest, compact
from service.api.context import Context
from service.api.documented import IDEMPOTENCY_KEY, SEQUENCE_CURSOR, SSE, success_as
from service.api.framing import framing
from service.api.readers import (
    admit_return,
    response_frames,
    response_renderer,
    response_sse,
    seated,
)
from service.api.request_ids import REQUEST_ID_HEADER, no_such_request
from service.api.response_input import kept, listed
from service.api.response_log import Found, entries, logged, response_object
from service.api.schemas import ResponsesRequest, error_responses
from service.api.status import ledger_row
from service.api.submit import accept
from service.errors import InvalidRequest
from service.stream import resume, sse
from service.stream.events import End
from service.stream.response_events import frames_after


class ResponsesController(Controller):
    path = "/v1/responses"
    tags = ("responses",)

    @post(
        "",
        status_code=200,
        summary="Create a response (OpenAI's Responses API)",
        operation_class=success_as(SSE, json=True, headers=(IDEMPOTENCY_KEY, SEQUENCE_CURSOR)),
        responses=error_responses(400, 401, 403, 404, 413, 422, 429, 503),
    )
    async def create(
        self,
        ctx: Context,
        principal: Principal,
        request: Request[Any, Any, Any],
        data: ResponsesRequest,
    ) -> Response[Any] | Stream:
        """``Idempotency-Key``: the same key and body again answer the same response (its
        stream from the start, or after ``Last-Event-ID``); another body, a 422."""
        framed = framing(request, ctx.settings.sse_framing)
        sub = await intake.response(ctx, data, principal)
        acc = await accept(ctx, sub, principal, await intake.idempotency(request))
        return await answers.response(ctx, request, acc, data, framed)

    @post(
        "/compact",
        status_code=200,
        summary="Compact a conversation into one compaction item (Open Responses)",
        responses=error_responses(400, 401, 403, 404, 413, 422, 429, 503),
    )
    async def compact(
        self,
        ctx: Context,
        principal: Principal,
        request: Request[Any, Any, Any],
        data: CompactRequest,
    ) -> Response[Any]:
        """The conversation (``input``, after ``previous_response_id``'s) summarised by
        the model into a ``compaction`` item: send it as input in place of those turns."""
        return await compact(ctx, request, principal, data)

    @get(
        "/{response_id:str}",
        summary="A response, or its events after starting_after (resumable)",
        operation_class=success_as(SSE, json=True, headers=(SEQUENCE_CURSOR,)),
        responses=error_responses(400, 401, 404),
    )
    async def retrieve(
        self,
        ctx: Context,
        principal: Principal,
        request: Request[Any, Any, Any],
        response_id: str,
        stream: bool = False,
        starting_after: int | None = None,
        include_obfuscation: bool | None = None,  # (no obfuscation here: nothing to turn off)
    ) -> Response[Any] | Stream:
        after = intake.sequence_cursor(request, starting_after)
        framed = framing(request, ctx.settings.sse_framing)
        if after is not None and not stream:
            raise InvalidRequest("'starting_after' needs 'stream=true'", param="starting_after")
        log, looked = await logged(ctx, response_id)
        plan = resume.sequence_plan(principal.tenant, looked, after)
        if isinstance(plan, resume.NotYours):
            raise no_such_request(response_id)
        headers = {REQUEST_ID_HEADER: response_id}
        if not stream:
            found = Found(plan.created, log, looked.hot)
            return Response(response_object(response_id, found), headers=headers)
        if isinstance(plan, resume.FromHotLog):  # follow it to its end, from what was just read
            frames = response_frames(
                ctx, response_id, plan.created, plan.cursor, logged=log, framing=framed
            )
            frames = seated(ctx, response_id, plan.created, frames)
            await admit_return(ctx, response_id, plan.created)
            return Stream(frames, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **headers})
        rendered = frames_after(
            response_renderer(response_id, plan.created), (e for _, e in log), plan.cursor
        )
        body = framed.opening(ctx.settings.reconnect_hint_ms) + response_sse(rendered, framed)
        return Response(body, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **headers})

    @post(
        "/{response_id:str}/cancel",
        status_code=200,
        summary="Cancel a response (idempotent)",
        responses=error_responses(401, 404),
    )
    async def cancel(self, ctx: Context, principal: Principal, response_id: str) -> dict[str, Any]:
        await entries(ctx, response_id, principal)  # (a response of this tenant's)
        await cancel_request(ctx, principal, response_id)
        return response_object(response_id, await entries(ctx, response_id, principal))

    @get(
        "/{response_id:str}/input_items",
        summary="A response's input items (earlier turns included)",
        responses=error_responses(400, 401, 404),
    )
    async def input_items(
        self,
        ctx: Context,
        principal: Principal,
        response_id: str,
        order: str = "desc",
        limit: int = 20,
        after: str | None = None,
    ) -> dict[str, Any]:
        """OpenAI's page: newest first by default (``order=asc``: oldest), ``limit`` 1-100,
        ``after`` an item id of the previous page."""
        if order not in ("asc", "desc"):
            raise InvalidRequest("'order' is 'asc' or 'desc'", param="order")
        if not 1 <= limit <= 100:
            raise InvalidRequest(f"'limit' is {limit}; 1 to 100", param="limit")
        found = await entries(ctx, response_id, principal)
        data = listed(response_id, kept(found.created.response)[1])
        if order == "desc":
            data.reverse()
        if after is not None:
            ids = [item["id"] for item in data]
            if after not in ids:
                raise InvalidRequest(f"no input item '{after[:64]}'", param="after")
            data = data[ids.index(after) + 1 :]
        page = data[:limit]
        return {
            "object": "list",
            "data": page,
            "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None,
            "has_more": len(data) > limit,
        }

    @delete(
        "/{response_id:str}",
        status_code=200,
        summary="Delete a response (its log and archive; the billing row stays)",
        responses=error_responses(401, 404),
    )
    async def remove(self, ctx: Context, principal: Principal, response_id: str) -> dict[str, Any]:
        """A running response is cancelled first. The hot log goes at once; the archive
        once the recorder has written the billing row (waited for, so that a recorder
        that read the log just before cannot archive it after the delete)."""
        found = await entries(ctx, response_id, principal)
        if not isinstance(found.entries[-1][1], End):
            await cancel_request(ctx, principal, response_id)
        await ctx.log.delete(response_id)
        if ctx.ledger is not None:
            deadline = time.monotonic() + ctx.settings.cancel_wait_s
            while await ledger_row(ctx, response_id) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await ctx.ledger.delete_archive(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
