"""POST /v1/chat/completions and POST /v1/completions; GET /v1/chat/completions (the
stored completions' list, beside the POST of its path: one route, one OPTIONS)."""

from __future__ import annotations

from typing import Any, Literal

from litestar import Controller, Request, Response, get, post
from litestar.response import Stream

from service.api import answers, intake, stored
from service.api.auth import Principal
from service.api.context import Context
from service.api.documented import EVENT_CURSOR, IDEMPOTENCY_KEY, SSE, success_as
from service.api.framing import framing
from service.api.schemas import ChatCompletionRequest, CompletionRequest, error_responses
from service.api.submit import accept

_READS = (IDEMPOTENCY_KEY, EVENT_CURSOR)


class CompletionsController(Controller):
    path = "/v1"
    tags = ("completions",)

    @post(
        "/chat/completions",
        status_code=200,
        summary="Create a chat completion",
        operation_class=success_as(SSE, json=True, headers=_READS),
        responses=error_responses(400, 401, 403, 404, 413, 422, 429, 503),
    )
    async def chat(
        self,
        ctx: Context,
        principal: Principal,
        request: Request[Any, Any, Any],
        data: ChatCompletionRequest,
    ) -> Response[Any] | Stream:
        framed = framing(request, ctx.settings.sse_framing)
        sub = await intake.chat(ctx, data, principal)
        acc = await accept(ctx, sub, principal, await intake.idempotency(request))
        return await answers.completion(
            ctx, request, acc, stream=data.stream, kind=sub.kind, framed=framed
        )

    @get(
        "/chat/completions",
        summary="List stored chat completions",
        responses=error_responses(400, 401, 503),
    )
    async def stored_completions(
        self,
        ctx: Context,
        principal: Principal,
        request: Request[Any, Any, Any],
        model: str | None = None,
        after: str | None = None,
        limit: int | None = None,
        order: Literal["asc", "desc"] = "asc",
    ) -> dict[str, Any]:
        """OpenAI's stored completions (``store: true``) of the caller's tenant."""
        return await stored.listing(
            ctx,
            principal,
            request,
            model=model,
            after=after,
            limit=limit,
            descending=order == "desc",
        )

    @post(
        "/completions",
        status_code=200,
        summary="Create a text completion",
        operation_class=success_as(SSE, json=True, headers=_READS),
        responses=error_responses(400, 401, 403, 404, 413, 422, 429, 503),
    )
    async def completions(
        self,
        ctx: Context,
        principal: Principal,
        request: Request[Any, Any, Any],
        data: CompletionRequest,
    ) -> Response[Any] | Stream:
        framed = framing(request, ctx.settings.sse_framing)
        sub = await intake.completion(ctx, data, principal)
        acc = await accept(ctx, sub, principal, await intake.idempotency(request))
        return await answers.completion(
            ctx, request, acc, stream=data.stream, kind=sub.kind, framed=framed
        )
