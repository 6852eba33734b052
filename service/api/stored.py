"""OpenAI's stored chat completions, the list: a tenant's chat completions sent with
``store: true``, read from the ledger (Postgres) -- one is there once the recorder wrote
its row, within moments of its end. (``routes/completions.py`` serves it beside the POST
of the same path; ``routes/stored.py`` serves one stored completion.)"""

from __future__ import annotations

from typing import Any

from litestar import Request

from service.api import audit
from service.api.auth import Principal
from service.api.context import Context
from service.errors import InvalidRequest

MOST = 100  # a page of the list, and of a completion's messages


def page(items: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    return {
        "object": "list",
        "data": items,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
        "has_more": has_more,
    }


async def listing(
    ctx: Context,
    principal: Principal,
    request: Request[Any, Any, Any],
    *,
    model: str | None,
    after: str | None,
    limit: int | None,
    descending: bool,
) -> dict[str, Any]:
    """The caller's tenant's stored completions, oldest first (``descending``: newest
    first); ``metadata[key]=value`` keeps those tagged so."""
    audit.texts(model=model, after=after)
    ledger = audit.ledger_of(ctx)
    found = await ledger.stored(
        principal.tenant,
        model=model,
        metadata=audit.metadata_filter(request),
        after=after,
        limit=audit.bounded_limit(limit, 20, MOST),
        descending=descending,
    )
    if found is None:
        raise InvalidRequest(f"after: no stored completion {after!r:.80}", param="after")
    blobs = await ledger.archives([r.id for r in found.rows])
    items = [audit.completion_object(r.id, audit.unpacked(blobs.get(r.id)), r) for r in found.rows]
    return page(items, found.has_more)
