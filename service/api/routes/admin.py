"""The operators' routes, behind the console (``/console``): find requests, open one
(input, output, events), replay it, reconcile billing, spend per day. An API key with the
``operator`` role (or the break-glass ``LASTEVENT_OPERATOR_TOKEN``) sees every tenant;
any other key its own tenant only -- another tenant's request is the unknown id's 404,
its rows are simply not there. Reconcile, which spans every tenant, is the operators'."""

from __future__ import annotations

import hmac
import math
from typing import Annotated, Any

from litestar import Controller, Request, Response, get
from litestar.params import QueryParameter
from litestar.response import Stream

from service.api import audit, billing
from service.api.auth import Principal
from service.api.context import Context
from service.api.documented import success_as
from service.api.request_ids import checked_request_id, no_such_request
from service.api.schemas import error_responses
from service.errors import Forbidden, InvalidRequest
from service.ledger.audit import Filters, Position, row_dict
from service.store.outbox import Outbox
from service.stream import replay, sse
from service.stream.events import Created

_BREAK_GLASS = Principal(tenant="", key_id=None, role="operator")
_PAGE_MOST = 200


async def _caller(ctx: Context, request: Request[Any, Any, Any]) -> Principal:
    """The caller's key, or the break-glass operator token (an operator of no tenant)."""
    token = ctx.settings.operator_token
    given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
    if token and hmac.compare_digest(given.encode(), token.encode()):
        return _BREAK_GLASS
    return await ctx.auth.principal(request.headers.get("authorization"))


async def _require_operator(ctx: Context, request: Request[Any, Any, Any]) -> Principal:
    principal = await _caller(ctx, request)
    if not audit.is_operator(principal):
        raise Forbidden("this route needs an API key with the operator role", code="forbidden")
    return principal


def _tenant(principal: Principal, asked: str | None) -> str | None:
    """The tenant a query is about: any for an operator, the caller's own otherwise."""
    return asked if audit.is_operator(principal) else principal.tenant


_REPLAY_MEDIA = {"sse": sse.MEDIA_TYPE, "text": "text/plain", "json": "application/x-ndjson"}


def _speed(raw: str) -> float | None:
    """``max`` (None: no waiting), or a finite factor (1 = the original timing)."""
    if raw == "max":
        return None
    try:
        rate = float(raw)
    except ValueError:
        rate = math.nan
    if not (math.isfinite(rate) and rate >= replay.MIN_SPEED):
        shown = raw[:40] + ("..." if len(raw) > 40 else "")
        raise InvalidRequest(
            f"speed is {shown!r}; it must be 'max' or a number of at least {replay.MIN_SPEED:g}",
            param="speed",
        )
    return rate


class AdminController(Controller):
    path = "/v1/admin"
    tags = ("admin",)

    @get(
        "/requests/{request_id:str}/replay",
        summary="Replay an answer as clients received it",
        operation_class=success_as(*_REPLAY_MEDIA.values(), json=False),
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
        principal = await _caller(ctx, request)
        if format not in ("sse", "text", "json"):
            raise InvalidRequest("format must be sse, text or json", param="format")
        rate = _speed(speed)
        entries = await audit.entries_of(ctx, checked_request_id(request_id))
        created = entries[0][1] if entries else None
        if not (isinstance(created, Created) and audit.visible(principal, created.tenant)):
            raise no_such_request(request_id)
        return Stream(
            replay.render(
                request_id,
                entries,
                speed=rate,
                fmt=format,
                reconnect_hint_ms=ctx.settings.reconnect_hint_ms,
            ),
            media_type=_REPLAY_MEDIA[format],
            headers=dict(sse.HEADERS),
        )

    @get("/me", summary="Who the key is (the console's login)", responses=error_responses(401))
    async def me(self, ctx: Context, request: Request[Any, Any, Any]) -> dict[str, Any]:
        principal = await _caller(ctx, request)
        return {"role": principal.role, "tenant": principal.tenant, "key_id": principal.key_id}

    @get(
        "/requests",
        summary="Find requests (filters, newest first, keyset paging)",
        responses=error_responses(400, 401, 503),
    )
    async def requests(
        self,
        ctx: Context,
        request: Request[Any, Any, Any],
        tenant: str | None = None,
        api_key: str | None = None,
        user: str | None = None,
        model: str | None = None,
        state_: Annotated[str | None, QueryParameter(name="state")] = None,
        error_code: str | None = None,
        finish_reason: str | None = None,
        kind: str | None = None,
        since: str | None = None,
        until: str | None = None,
        limit: int | None = None,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        principal = await _caller(ctx, request)
        audit.texts(
            tenant=tenant,
            api_key=api_key,
            user=user,
            model=model,
            state=state_,
            error_code=error_code,
            finish_reason=finish_reason,
            kind=kind,
            cursor=cursor,
        )
        after = None
        if cursor:
            after = Position.decode(cursor)
            if after is None:
                raise InvalidRequest("cursor is not one this server gave", param="cursor")
        filters = Filters(
            tenant=_tenant(principal, tenant),
            api_key_id=api_key,
            end_user=user,
            model=model,
            state=state_,
            error_code=error_code,
            finish_reason=finish_reason,
            kind=kind,
            metadata=audit.metadata_filter(request),
            since=audit.moment(since, "since"),
            until=audit.moment(until, "until"),
        )
        most = audit.bounded_limit(limit, 50, _PAGE_MOST)
        rows, following = await audit.ledger_of(ctx).requests(filters, limit=most, after=after)
        return {
            "object": "list",
            "data": [row_dict(r) for r in rows],
            "next_cursor": following.encode() if following else None,
        }

    @get(
        "/requests/{request_id:str}",
        summary="A request: its row, input, output and events",
        responses=error_responses(401, 404, 503),
    )
    async def request_page(
        self, ctx: Context, request: Request[Any, Any, Any], request_id: str
    ) -> dict[str, Any]:
        principal = await _caller(ctx, request)
        return await audit.request_page(ctx, principal, checked_request_id(request_id))

    @get(
        "/billing/reconcile",
        summary="Reconcile the ledger with the outbox over a range",
        responses=error_responses(400, 401, 403, 503),
    )
    async def reconcile(
        self, ctx: Context, request: Request[Any, Any, Any], since: str, until: str
    ) -> dict[str, Any]:
        await _require_operator(ctx, request)
        start, end = _range(since, until)
        if ctx.ledger is None:
            audit.ledger_of(ctx)  # (the 503 that says so)
        assert ctx.ledger is not None
        outbox = Outbox(ctx.redis, ctx.log.keys)
        report = await billing.reconcile(outbox, ctx.log, ctx.ledger, start, end)
        return {
            "checked": report.checked,
            "clean": report.clean,
            "missing": report.missing,
            "duplicate": report.duplicate,
            "mismatched": [
                {"id": rid, "field": f, "row": got, "log": want}
                for rid, f, got, want in report.mismatched
            ],
            "unexpected": report.unexpected,
        }

    @get(
        "/billing/spend",
        summary="Usage per day, tenant and model (JSON or CSV)",
        operation_class=success_as("text/csv", json=True),
        responses=error_responses(400, 401, 503),
    )
    async def spend(
        self,
        ctx: Context,
        request: Request[Any, Any, Any],
        since: str,
        until: str,
        tenant: str | None = None,
        format: str = "json",
    ) -> Response[Any]:
        principal = await _caller(ctx, request)
        if format not in ("json", "csv"):
            raise InvalidRequest("format must be json or csv", param="format")
        start, end = _range(since, until)
        audit.texts(tenant=tenant)
        rows = await audit.ledger_of(ctx).spend(start, end, _tenant(principal, tenant))
        if format == "json":
            return Response({"object": "list", "data": rows})
        name = f"spend-{start.date()}-{end.date()}.csv"
        return Response(
            billing.csv_text(rows),
            media_type="text/csv",  # (Litestar adds the charset)
            headers={"Content-Disposition": f'attachment; filename="{name}"'},
        )


def _range(since: str, until: str) -> tuple[Any, Any]:
    start, end = audit.moment(since, "since"), audit.moment(until, "until")
    if start is None or end is None or not start < end:
        raise InvalidRequest("since must be before until", param="until")
    return start, end
