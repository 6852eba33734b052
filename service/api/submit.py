"""Accepting a checked request (``intake.Submission``): admission, then the log, the
caller's reader lease and the job in one step -- or, for a POST whose
``Idempotency-Key`` made a request already, that request again.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

from service.api import tokens
from service.api.auth import Principal
from service.api.context import Context
from service.api.intake import IDEMPOTENCY_HEADER, Idempotency, Submission
from service.api.request_ids import REQUEST_ID_HEADER, new_request_id, no_such_request
from service.errors import Unprocessable
from service.store.keys import principal as who
from service.store.queue import Job, encode_job
from service.store.readers import Lease
from service.stream.events import Created

REPLAYED_HEADER = "Idempotent-Replayed"  # the answer is that of an earlier POST (Stripe's name)


@dataclasses.dataclass(frozen=True, slots=True)
class Accepted:
    """A request the POST stands for: new, or (``replayed``) the one its
    ``Idempotency-Key`` made before. ``lease``: the caller's reader lease, taken with the
    request (None for a replay: its reader takes one). ``headers``: what every answer
    about it carries (its id, a stream token to read it without the API key)."""

    request_id: str
    created: Created
    lease: Lease | None
    headers: dict[str, str]

    @property
    def replayed(self) -> bool:
        return self.lease is None


async def accept(
    ctx: Context, sub: Submission, principal: Principal, idempotency: Idempotency | None
) -> Accepted:
    """The request ``sub`` asks for: submitted, or found again by its Idempotency-Key
    (the same key and body: the same request; another body: a 422)."""
    signer = await ctx.stream_tokens()  # (before the request exists: nothing to undo)
    if idempotency is None:
        rid, created, lease = await submit(ctx, sub, principal)
        return Accepted(rid, created, lease, _headers(signer, principal, rid))
    who_ = who(principal.tenant, principal.key_id)
    rid = new_request_id(sub.kind, sub.model)
    bound = await ctx.idempotency.claim(who_, idempotency.key, rid, idempotency.digest)
    if bound is not None:  # a retry after a lost response, or another request entirely
        return await _again(ctx, principal, bound, idempotency, signer)
    try:
        rid, created, lease = await submit(ctx, sub, principal, rid)
    except BaseException:  # refused (429, 503, ...): a retry with this key may try again
        with contextlib.suppress(Exception):
            await ctx.idempotency.release(who_, idempotency.key, rid)
        raise
    return Accepted(rid, created, lease, _headers(signer, principal, rid))


def _headers(signer: tokens.StreamTokens, principal: Principal, rid: str) -> dict[str, str]:
    """The request id, and a stream token for reading it without the API key."""
    return {REQUEST_ID_HEADER: rid, tokens.HEADER: signer.issue(principal, rid)}


async def _again(
    ctx: Context,
    principal: Principal,
    bound: tuple[str, str],
    idempotency: Idempotency,
    signer: tokens.StreamTokens,
) -> Accepted:
    """The request an Idempotency-Key made already -- with another body, a 422 (the key
    names one request, never two)."""
    rid, bound_digest = bound
    if bound_digest != idempotency.digest:
        raise Unprocessable(
            "this Idempotency-Key was used with another request body",
            param=IDEMPOTENCY_HEADER,
            code="idempotency_key_reused",
        )
    created = None
    for _ in range(50):  # the first POST may still be creating it (one round trip)
        created = await ctx.log.first(rid)
        if created is not None:
            break
        await asyncio.sleep(0.05)
    if created is None or created.tenant != principal.tenant:
        raise no_such_request(rid)
    headers = {**_headers(signer, principal, rid), REPLAYED_HEADER: "true"}
    return Accepted(rid, created, None, headers)


async def submit(
    ctx: Context, sub: Submission, principal: Principal, request_id: str | None = None
) -> tuple[str, Created, Lease]:
    """Create the log (``created`` event), take the caller's reader lease, enqueue the job.

    The lease exists before any worker can see the job, so a worker never mistakes a
    request whose client is still connecting for an abandoned one."""
    rid = request_id or new_request_id(sub.kind, sub.model)
    await ctx.admission.check_capacity(len(ctx.presence), sub.model)
    await ctx.admission.admit(who(principal.tenant, principal.key_id), rid)
    created = Created(
        kind=str(sub.kind),
        model=sub.model,
        created=int(time.time()),
        prompt_tokens=len(sub.prompt_token_ids),
        include_usage=sub.include_usage,
        tenant=principal.tenant,
        api_key_id=principal.key_id,
        n=sub.n,
        user=sub.user,
        continuous_usage=sub.continuous_usage,
        response=sub.response,
        store=sub.store,
        input=sub.input,
        metadata=sub.metadata,
        listed=sub.listed,
    )
    settings = ctx.settings
    safety_ttl_s = ctx.log.retention.running_ttl_s  # (``Retention``: the one TTL arithmetic)
    job = Job(
        request_id=rid,
        prompt_token_ids=sub.prompt_token_ids,
        params=sub.params,
        deadline_unix_s=time.time() + settings.request_deadline_s,
        n=sub.n,
        tools=sub.tools,
        model=sub.model,
        conversation=sub.conversation,
        images=sub.images,
    )
    # the log, the caller's reader lease and the job: one script, one round trip (each
    # await is a turn of a busy event loop: five of them made a burst of starts slow)
    lease = ctx.presence.track(rid, adopted=False)
    try:
        await ctx.log.create(
            rid,
            created,
            safety_ttl_s,
            grace_ms=int(sub.resume_grace_s * 1000),
            detached=sub.detached,
            lease=(lease.token, ctx.presence.expiry_ms()),
            job=encode_job(job),
        )
    except BaseException:
        ctx.presence.forget(lease)
        raise
    return rid, created, lease
