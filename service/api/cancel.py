"""Cancelling a request of the caller's, from any API replica, in any phase: still queued,
it is ended on the spot (its ending from ``endings.cancelled_queued``; no engine sees
it); running, its owner is told and aborts it at its next engine step; ended, nothing
changes. ``POST /v1/requests/{id}/cancel``, ``POST /v1/responses/{id}/cancel`` and
``DELETE /v1/responses/{id}`` all cancel through here."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from service.api.auth import Principal
from service.api.context import Context
from service.api.request_ids import checked_request_id, no_such_request, owned
from service.api.status import request_status
from service.stream import endings
from service.stream.lifecycle import State


async def cancel_request(ctx: Context, principal: Principal, request_id: str) -> dict[str, Any]:
    """Cancel the caller's request; its status once terminal (or after ``cancel_wait_s``)."""
    checked_request_id(request_id)
    first = await ctx.log.first_with_id(request_id)
    created = owned(first[1] if first is not None else None, principal, request_id)
    now_ms = int(time.time() * 1000)
    queued = endings.cancelled_queued(
        endings.Request(request_id, first, created.prompt_tokens, now_ms)
    )
    outcome = await ctx.control.cancel(request_id, queued)
    if outcome.outcome == "missing":
        raise no_such_request(request_id)
    deadline = time.monotonic() + ctx.settings.cancel_wait_s
    while True:
        found = await request_status(ctx, request_id)
        if found is None:
            raise no_such_request(request_id)
        found.pop("tenant", None)
        if State(found["state"]).terminal or time.monotonic() >= deadline:
            return found
        await asyncio.sleep(0.02)
