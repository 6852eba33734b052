"""OpenAI's stored chat completions: a chat completion sent with ``store: true`` is kept
with its input and ``metadata``, and its tenant lists, retrieves, re-tags and deletes it.

The list reads the ledger (Postgres): a completion is there once the recorder wrote its
row, within moments of its end. Deleting one removes its input and answer (the archive,
and the hot log if it is still there); its billing row stays, unlisted."""

from __future__ import annotations

from typing import Any, Literal

from litestar import Controller, delete, get, post

from service.api import audit
from service.api.auth import Principal
from service.api.context import Context
from service.api.request_ids import checked_request_id, no_such_request
from service.api.schemas import MetadataUpdate, error_responses
from service.api.stored import MOST, page
from service.errors import InvalidRequest
from service.ledger.models import RequestRow
from service.stream.events import Created


async def _stored(ctx: Context, principal: Principal, completion_id: str) -> RequestRow:
    """The tenant's stored completion, or the unknown id's 404."""
    rid = checked_request_id(completion_id)
    row = await audit.ledger_of(ctx).stored_one(principal.tenant, rid)
    if row is None:
        raise no_such_request(rid)
    return row


class StoredCompletionsController(Controller):
    path = "/v1/chat/completions"
    tags = ("stored completions",)

    @get(
        "/{completion_id:str}",
        summary="Retrieve a stored chat completion",
        responses=error_responses(401, 404, 503),
    )
    async def retrieve(
        self, ctx: Context, principal: Principal, completion_id: str
    ) -> dict[str, Any]:
        row = await _stored(ctx, principal, completion_id)
        return audit.completion_object(row.id, await audit.entries_of(ctx, row.id), row)

    @get(
        "/{completion_id:str}/messages",
        summary="The input messages of a stored chat completion",
        responses=error_responses(400, 401, 404, 503),
    )
    async def messages(
        self,
        ctx: Context,
        principal: Principal,
        completion_id: str,
        after: str | None = None,
        limit: int | None = None,
        order: Literal["asc", "desc"] = "asc",
    ) -> dict[str, Any]:
        row = await _stored(ctx, principal, completion_id)
        entries = await audit.entries_of(ctx, row.id)
        created = entries[0][1] if entries else None
        found = audit.messages_of(row.id, created) if isinstance(created, Created) else []
        if order == "desc":
            found.reverse()
        if after is not None:
            ids = [m["id"] for m in found]
            if after not in ids:
                raise InvalidRequest(f"after: no message {after!r:.80}", param="after")
            found = found[ids.index(after) + 1 :]
        most = audit.bounded_limit(limit, 20, MOST)
        return page(found[:most], len(found) > most)

    @post(
        "/{completion_id:str}",
        status_code=200,
        summary="Update a stored chat completion's metadata",
        responses=error_responses(400, 401, 404, 503),
    )
    async def update(
        self, ctx: Context, principal: Principal, completion_id: str, data: MetadataUpdate
    ) -> dict[str, Any]:
        await _stored(ctx, principal, completion_id)
        row = await audit.ledger_of(ctx).set_metadata(
            principal.tenant, completion_id, data.metadata
        )
        if row is None:  # deleted meanwhile
            raise no_such_request(completion_id)
        return audit.completion_object(row.id, await audit.entries_of(ctx, row.id), row)

    @delete(
        "/{completion_id:str}",
        status_code=200,
        summary="Delete a stored chat completion (its billing row stays)",
        responses=error_responses(401, 404, 503),
    )
    async def remove(
        self, ctx: Context, principal: Principal, completion_id: str
    ) -> dict[str, Any]:
        rid = checked_request_id(completion_id)
        if not await audit.ledger_of(ctx).forget(principal.tenant, rid):
            raise no_such_request(rid)
        await ctx.log.delete(rid)  # the hot log, if it is still there
        return {"object": "chat.completion.deleted", "id": rid, "deleted": True}
