"""Operator-only routes: an API key with the ``operator`` role (operators may replay
any tenant's request), or the break-glass ``LASTEVENT_OPERATOR_TOKEN``."""

from __future__ import annotations

import hmac
import math
from typing import Any

from litestar import Controller, Request, get
from litestar.response import Stream

from service.api.context import Context
from service.api.request_ids import checked_request_id, no_such_request
from service.api.schemas import error_responses
from service.errors import Forbidden, InvalidRequest
from service.stream import replay, sse


async def _require_operator(ctx: Context, request: Request[Any, Any, Any]) -> None:
    """An API key with the operator role, or the break-glass operator token."""
    token = ctx.settings.operator_token
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if token and hmac.compare_digest(given.encode(), token.encode()):
        return
    principal = await ctx.auth.principal(request.headers.get("authorization"))
    if principal.role != "operator":
        raise Forbidden("this route needs an API key with the operator role", code="forbidden")


_MIN_SPEED = 0.01  # a hundred times slower than the original


def _speed(raw: str) -> float | None:
    """``max`` (None: no waiting), or a finite factor (1 = the original timing)."""
    if raw == "max":
        return None
    try:
        rate = float(raw)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate >= _MIN_SPEED):
        shown = raw[:40] + ("..." if len(raw) > 40 else "")
        raise InvalidRequest(
            f"speed is {shown!r}; it must be 'max' or a number of at least {_MIN_SPEED:g}",
            param="speed",
        )
    return rate


class AdminController(Controller):
    path = "/v1/admin"
    tags = ("admin",)

    @get(
        "/requests/{request_id:str}/replay",
        summary="Replay an answer as clients received it",
        responses=error_responses(400, 401, 403, 404),
    )
    async def replay(
        self,
        ctx: Context,
        request: Request[Any, Any, Any],
        request_id: str,
        speed: str = "max",
        format: str = "sse",
    ) -> Stream:
        await _require_operator(ctx, request)
        if format not in ("sse", "text", "json"):
            raise InvalidRequest("format must be sse, text or json", param="format")
        rate = _speed(speed)
        entries = await ctx.log.read(checked_request_id(request_id))
        if not entries and ctx.ledger is not None:
            entries = await ctx.ledger.archived(request_id) or []
        if not entries:
            raise no_such_request(request_id)
        media = {"sse": sse.MEDIA_TYPE, "text": "text/plain", "json": "application/x-ndjson"}
        return Stream(
            replay.render(
                request_id,
                entries,
                speed=rate,
                fmt=format,
                reconnect_hint_ms=ctx.settings.reconnect_hint_ms,
            ),
            media_type=media[format],
            headers=dict(sse.HEADERS),
        )
