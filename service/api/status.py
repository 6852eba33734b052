"""``GET /v1/requests/{id}``'s answer: from the hot log, else from the ledger."""

from __future__ import annotations

from typing import Any

from service.api.context import Context
from service.stream.events import End
from service.stream.render import usage


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
    row = await ctx.ledger.get(rid) if ctx.ledger is not None else None
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
