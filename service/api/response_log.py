"""A response's log, hot or archived, as the Responses routes read it: scoped to the
caller's tenant, rendered as the response object, or as the input items a later turn
(``previous_response_id``) continues from."""

from __future__ import annotations

import dataclasses
from typing import Any

from service.api.auth import Principal
from service.api.context import Context
from service.api.readers import response_renderer
from service.api.request_ids import checked_request_id, no_such_request
from service.api.response_input import as_input, kept
from service.errors import InvalidRequest, NotFound
from service.stream import resume
from service.stream.events import Created, Event, Kind
from service.stream.ids import EventId


@dataclasses.dataclass(frozen=True, slots=True)
class Found:
    created: Created
    entries: list[tuple[EventId, Event]]
    hot: bool  # read from Redis (else from the archive: it has ended)


async def logged(ctx: Context, rid: str) -> tuple[list[tuple[EventId, Event]], resume.Looked]:
    """The response's log, hot or archived, whoever's it is: what its plan decides on."""
    found = await ctx.log.read(checked_request_id(rid))
    hot = bool(found)
    if not hot and ctx.ledger is not None:
        found = await ctx.ledger.archived(rid) or []
    return found, resume.Looked.whole(found, None, hot=hot)


async def entries(ctx: Context, rid: str, principal: Principal) -> Found:
    """The response's log, hot or archived; 404 for another tenant's or a non-response."""
    found, looked = await logged(ctx, rid)
    created = resume.owner(looked.first, principal.tenant, Kind.RESPONSE)
    if created is None:
        raise no_such_request(rid)
    return Found(created, found, looked.hot)


def response_object(rid: str, found: Found) -> dict[str, Any]:
    renderer = response_renderer(rid, found.created)
    for _, event in found.entries:
        renderer.feed(event)
    return renderer.response_object()


async def earlier_items(ctx: Context, principal: Principal, rid: str) -> list[dict[str, Any]]:
    """The conversation so far of ``previous_response_id``: its whole input (which holds
    the turns before it) and its output, as input items; hot or from the archive."""
    try:
        found = await entries(ctx, rid, principal)
    except NotFound:
        raise NotFound(
            f"no response '{rid[:64]}'", param="previous_response_id", code="not_found"
        ) from None
    before = response_object(rid, found)
    if before["status"] in ("queued", "in_progress"):
        raise InvalidRequest(
            f"response '{rid}' has not ended: its output cannot be continued yet",
            param="previous_response_id",
        )
    return kept(found.created.response)[1] + as_input(before["output"])
