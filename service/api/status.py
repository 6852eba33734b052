"""``GET /v1/requests/{id}``'s answer: from the hot log, else from the ledger.

When the hot log is gone and Postgres cannot be asked, the answer is a 503 with
``Retry-After`` (``ledger_unavailable``): not a 404, which would say the request never
existed, and not a 500. ``archived`` is the same for the event stream's archive.
"""

from __future__ import annotations

import logging
from typing import Any

from service.api.context import Context
from service.errors import ServiceUnavailable
from service.ledger.ledger import PostgresUnavailable
from service.ledger.models import RequestRow
from service.stream.events import End, Event
from service.stream.ids import EventId
from service.stream.render import usage

log = logging.getLogger("lastevent.api")

RETRY_AFTER_S = 2


def ledger_unavailable(exc: PostgresUnavailable) -> ServiceUnavailable:
    """The API's answer when the ledger (Postgres) cannot be asked."""
    log.warning("the ledger is unavailable: %s", exc)
    return ServiceUnavailable(
        "this request is no longer in the event log, and the ledger is unavailable; retry",
        code="ledger_unavailable",
        retry_after_s=RETRY_AFTER_S,
    )


async def ledger_row(ctx: Context, rid: str) -> RequestRow | None:
    """The request's ledger row (``None``: no such request, or no ledger); 503 if
    Postgres cannot be asked."""
    if ctx.ledger is None:
        return None
    try:
        return await ctx.ledger.get(rid)
    except PostgresUnavailable as exc:
        raise ledger_unavailable(exc) from exc


async def archived(ctx: Context, rid: str) -> list[tuple[EventId, Event]] | None:
    """The request's archived log (``None``: none, or no ledger); 503 if Postgres cannot
    be asked."""
    if ctx.ledger is None:
        return None
    try:
        return await ctx.ledger.archived(rid)
    except PostgresUnavailable as exc:
        raise ledger_unavailable(exc) from exc


async def request_status(ctx: Context, rid: str) -> dict[str, Any] | None:
    """State, finish_reason, usage and last event id: from the hot log, else the ledger."""
    meta = await ctx.log.meta(rid)
    if meta is not None:
        created = await ctx.log.first(rid)
        last = await ctx.log.last(rid)
        end = last[1] if last is not None and isinstance(last[1], End) else None
        return {
            "id": rid,
            "object": "request",
            "tenant": created.tenant if created else None,
            "state": meta.state,
            "model": created.model if created else None,
            "created": created.created if created else None,
            "finish_reason": end.finish_reason if end else None,
            "usage": usage(end) if end else None,
            "last_event_id": meta.last_event_id,
        }
    row = await ledger_row(ctx, rid)
    if row is None:
        return None
    return {
        "id": row.id,
        "object": "request",
        "tenant": row.tenant,
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
