"""OpenAI's Responses API over the same request log: ``POST /v1/responses`` (streaming,
not, or ``background``), ``GET /v1/responses/{id}`` (the object, or its events after
``starting_after`` / ``Last-Event-ID``), ``POST /v1/responses/{id}/cancel``,
``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``.

A response is a request like a chat completion (the same prompt, tools, structured
output, worker and log); only its rendering differs (``stream/responses.py``), and it
counts its events from the log's start, so a stream resumed on any replica, or read
back from the archive, has the same sequence numbers and bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import msgspec
from litestar import Controller, Request, Response, delete, get, post
from litestar.response import Stream

from service.api.auth import Principal
from service.api.context import Context
from service.api.readers import (
    response_collect,
    response_frames,
    response_renderer,
    response_sse,
)
from service.api.responses import (
    ResponsesRequest,
    as_input,
    chat_body,
    check,
    input_items,
    kept,
    listed,
    stored,
)
from service.api.routes.completions import REQUEST_ID_HEADER, JsonBodyRequest, until_disconnect
from service.api.routes.requests import cancel_request
from service.api.schemas import ChatCompletionRequest, error_responses
from service.api.status import ledger_row
from service.api.submit import (
    chat_submission,
    check_model,
    checked_request_id,
    no_such_request,
    submit,
)
from service.errors import InvalidRequest, NotFound
from service.stream import sse
from service.stream.events import Created, End, Event, Kind
from service.stream.ids import EventId
from service.stream.responses import frames_after


def _chat(data: ResponsesRequest, items: list[dict[str, Any]]) -> ChatCompletionRequest:
    try:
        return msgspec.convert(chat_body(data, items), ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid input: {exc}", param="input") from None


@dataclasses.dataclass(frozen=True, slots=True)
class _Found:
    created: Created
    entries: list[tuple[EventId, Event]]
    hot: bool  # read from Redis (else from the archive: it has ended)


async def _entries(ctx: Context, rid: str, principal: Principal) -> _Found:
    """The response's log, hot or archived; 404 for another tenant's or a non-response."""
    entries = await ctx.log.read(checked_request_id(rid))
    hot = bool(entries)
    if not hot and ctx.ledger is not None:
        entries = await ctx.ledger.archived(rid) or []
    created = entries[0][1] if entries else None
    if (
        not isinstance(created, Created)
        or created.tenant != principal.tenant
        or created.kind != Kind.RESPONSE
    ):
        raise no_such_request(rid)
    return _Found(created, entries, hot)


async def _continued(ctx: Context, principal: Principal, rid: str) -> list[dict[str, Any]]:
    """The conversation so far of ``previous_response_id``: its whole input (which holds
    the turns before it) and its output, as input items; hot or from the archive."""
    try:
        found = await _entries(ctx, rid, principal)
    except NotFound:
        raise NotFound(
            f"no response '{rid[:64]}'", param="previous_response_id", code="not_found"
        ) from None
    before = _object(rid, found)
    if before["status"] in ("queued", "in_progress"):
        raise InvalidRequest(
            f"response '{rid}' has not ended: its output cannot be continued yet",
            param="previous_response_id",
        )
    return kept(found.created.response)[1] + as_input(before["output"])


def _object(rid: str, found: _Found) -> dict[str, Any]:
    renderer = response_renderer(rid, found.created)
    for _, event in found.entries:
        renderer.feed(event)
    return renderer.response_object()


class ResponsesController(Controller):
    path = "/v1/responses"
    tags = ("responses",)
    request_class = JsonBodyRequest

    @post(
        "",
        status_code=200,
        summary="Create a response (OpenAI's Responses API)",
        responses=error_responses(400, 401, 403, 404, 413, 429, 503),
    )
    async def create(
        self,
        ctx: Context,
        principal: Principal,
        request: Request[Any, Any, Any],
        data: ResponsesRequest,
    ) -> Response[Any] | Stream:
        check(data)
        items = input_items(data)
        if data.previous_response_id is not None:
            items = await _continued(ctx, principal, data.previous_response_id) + items
        chat = _chat(data, items)
        check_model(ctx, chat, principal)
        sub = chat_submission(
            ctx,
            chat,
            Kind.RESPONSE,
            data.max_output_tokens,
            max_param="max_output_tokens",
            prompt_param="input",
        )
        # background: no reader needed (it runs to its end, readable meanwhile and after)
        sub = dataclasses.replace(
            sub,
            response=stored(data, items),
            detached=data.background,
            store=data.store is not False,
        )
        rid, created, lease = await submit(ctx, sub, data.model, principal)
        headers = {REQUEST_ID_HEADER: rid}
        if data.stream:
            frames = response_frames(ctx, rid, created, None, lease)
            return Stream(frames, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **headers})
        if data.background:  # answered at once, queued
            await lease.release()
            renderer = response_renderer(rid, created)
            renderer.feed(created)
            return Response(renderer.response_object(), headers=headers)
        done = await until_disconnect(request, response_collect(ctx, rid, created, lease))
        if done is None:  # the client went away; the grace period runs
            return Response(b"", status_code=499, headers=headers)
        return Response(done.response_object(), headers=headers)

    @get(
        "/{response_id:str}",
        summary="A response, or its events after starting_after (resumable)",
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
        header = request.headers.get("last-event-id")
        after = starting_after
        if header:
            if not header.isdigit():
                raise InvalidRequest(
                    "Last-Event-ID of a response stream is a sequence number",
                    param="Last-Event-ID",
                    code="invalid_event_id",
                )
            after = int(header)
        if after is not None and not stream:
            raise InvalidRequest("'starting_after' needs 'stream=true'", param="starting_after")
        found = await _entries(ctx, response_id, principal)
        headers = {REQUEST_ID_HEADER: response_id}
        if not stream:
            return Response(_object(response_id, found), headers=headers)
        if found.hot:  # follow it to its end, from what was just read
            frames = response_frames(ctx, response_id, found.created, after, logged=found.entries)
            return Stream(frames, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **headers})
        rendered = frames_after(
            response_renderer(response_id, found.created), (e for _, e in found.entries), after
        )
        body = sse.retry_line(ctx.settings.reconnect_hint_ms) + response_sse(rendered)
        return Response(body, media_type=sse.MEDIA_TYPE, headers={**sse.HEADERS, **headers})

    @post(
        "/{response_id:str}/cancel",
        status_code=200,
        summary="Cancel a response (idempotent)",
        responses=error_responses(401, 404),
    )
    async def cancel(self, ctx: Context, principal: Principal, response_id: str) -> dict[str, Any]:
        await _entries(ctx, response_id, principal)  # (a response of this tenant's)
        await cancel_request(ctx, principal, response_id)
        return _object(response_id, await _entries(ctx, response_id, principal))

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
        found = await _entries(ctx, response_id, principal)
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
        found = await _entries(ctx, response_id, principal)
        if not isinstance(found.entries[-1][1], End):
            await cancel_request(ctx, principal, response_id)
        await ctx.log.delete(response_id)
        if ctx.ledger is not None:
            deadline = time.monotonic() + ctx.settings.cancel_wait_s
            while await ledger_row(ctx, response_id) is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await ctx.ledger.delete_archive(response_id)
        return {"id": response_id, "object": "response", "deleted": True}
