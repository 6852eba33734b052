"""Operator-only routes. Until API keys with roles exist, an operator presents
``Authorization: Bearer $LASTEVENT_OPERATOR_TOKEN``; with no token configured the
routes are closed (403)."""

from __future__ import annotations

import hmac
from typing import Any

from litestar import Controller, Request, get
from litestar.response import Stream

from service import replay
from service.errors import ApiError, InvalidRequest, NotFound
from service.requests import Context
from service.stream import sse


class Forbidden(ApiError):
    status_code = 403
    error_type = "permission_error"


def _require_operator(ctx: Context, request: Request[Any, Any, Any]) -> None:
    token = ctx.settings.operator_token
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if not token or not hmac.compare_digest(given.encode(), token.encode()):
        raise Forbidden("operator role required", code="forbidden")


class AdminController(Controller):
    path = "/v1/admin"
    tags = ["admin"]

    @get("/requests/{request_id:str}/replay", summary="Replay an answer as clients received it")
    async def replay(
        self,
        ctx: Context,
        request: Request[Any, Any, Any],
        request_id: str,
        speed: str = "max",
        format: str = "sse",  # noqa: A002 - the public parameter name
    ) -> Stream:
        _require_operator(ctx, request)
        if format not in ("sse", "text", "json"):
            raise InvalidRequest("format must be sse, text or json", param="format")
        try:
            rate = None if speed == "max" else float(speed)
        except ValueError:
            raise InvalidRequest("speed must be a number or 'max'", param="speed") from None
        try:
            entries = await replay.load(ctx.log, ctx.ledger, request_id)
        except replay.NotFoundError:
            raise NotFound(f"no request '{request_id}'", param="request_id") from None
        media = {"sse": sse.MEDIA_TYPE, "text": "text/plain", "json": "application/x-ndjson"}
        return Stream(
            replay.render(request_id, entries, speed=rate, fmt=format),
            media_type=media[format],
            headers=dict(sse.HEADERS),
        )
