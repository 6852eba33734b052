"""Cancelling a request of the caller's, from any API replica, in any phase: still queued
or parked, it is ended on the spot (its ending from ``endings.py``; no engine sees it
again); running, its owner is told and aborts it at its next engine step; ended,
nothing changes. ``POST /v1/requests/{id}/cancel``, ``POST /v1/responses/{id}/cancel``
and ``DELETE /v1/responses/{id}`` all cancel through here."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from service.api.auth import Principal
from service.api.context import Context
from service.api.request_ids import checked_request_id, no_such_request, owned
from service.api.status import request_status
from service.store.scripts.codes import CancelReply
from service.stream import endings
from service.stream.endings import Ending
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
    deadline = time.monotonic() + ctx.settings.cancel_wait_s
    outcome = await ctx.log.cancel(request_id, queued)
    while True:
        if outcome.outcome == CancelReply.MISSING:
            raise no_such_request(request_id)
        found = await request_status(ctx, request_id)
        if found is None:
            raise no_such_request(request_id)
        found.pop("tenant", None)
        state = State(found["state"])
        if state.terminal or time.monotonic() >= deadline:
            return found
        if state == State.PARKED or outcome.outcome == CancelReply.STALE:
            # parked (before the cancel, or while its worker was being told): ended here,
            # with the ending of the log as it is
            parked = await _parked(ctx, request_id)
            outcome = await ctx.log.cancel(request_id, queued, parked)
            continue
        await asyncio.sleep(0.02)


async def _parked(ctx: Context, rid: str) -> tuple[Ending, int] | None:
    """The ending of the request if it is parked, and the log entries it was made from."""
    w = await ctx.log.written(rid)
    if w.meta is None or w.meta.state != State.PARKED:
        return None
    return endings.cancelled_parked(w.request, w.completion_tokens), w.meta.events
