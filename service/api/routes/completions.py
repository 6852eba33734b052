"""POST /v1/chat/completions and POST /v1/completions."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import re
from collections.abc import Coroutine
from typing import Any, TypeVar

import msgspec
from litestar import Controller, Request, Response, post
from litestar.response import Stream

from service.api import tokens
from service.api.auth import Principal
from service.api.context import Context
from service.api.contract import check_refused, completion_output
from service.api.metrics import REQUESTS
from service.api.readers import collect, nothing_after, sse_frames
from service.api.schemas import ChatCompletionRequest, CompletionRequest, error_responses
from service.api.submit import (
    Submission,
    chat_submission,
    check_model,
    foreign_cursor,
    new_request_id,
    no_such_request,
    parse_cursor,
    submission,
    submit,
)
from service.errors import ApiError, InvalidRequest, Unprocessable
from service.store.keys import principal as who
from service.store.presence import Lease
from service.stream import sse
from service.stream.events import Created, Kind
from service.stream.lifecycle import State
from service.stream.render import error_object

REQUEST_ID_HEADER = "X-Request-Id"
IDEMPOTENCY_HEADER = "Idempotency-Key"
REPLAYED_HEADER = "Idempotent-Replayed"  # the answer is that of an earlier POST (Stripe's name)
_KEY = re.compile(r"[\x21-\x7e]{1,255}")
T = TypeVar("T")

# a number too large for a float (1e400) becomes inf, so that the field's own bound names
# it in the 400 (decoded to Any, msgspec could only say "out of range at $[...]")
_JSON = msgspec.json.Decoder(float_hook=float)


class JsonBodyRequest(Request[Any, Any, Any]):
    """Litestar's request, but a body that is not JSON is always a 400: Litestar's own
    decoding lets a RecursionError (``[[[[...]]]]`` nested deep enough) become a 500."""

    async def json(self) -> Any:
        body = await self.body()
        try:
            return _JSON.decode(body or b"null")
        except RecursionError:
            raise InvalidRequest("the JSON body is nested too deeply") from None
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"the body is not valid JSON: {exc}") from None


async def _answer(
    ctx: Context,
    request: Request[Any, Any, Any],
    body: Any,
    sub: Submission,
    principal: Principal,
) -> Response[Any] | Stream:
    signer = await ctx.stream_tokens()  # (before the request exists: nothing to undo)
    key = idempotency_key(request)
    if key is None:
        rid, created, lease = await submit(ctx, sub, body.model, principal)
    else:  # the same key and body again (a retry after a lost response): the same request
        who_ = who(principal.tenant, principal.key_id)
        # the body's JSON, not its bytes: a retry may space or order it another way
        canonical = msgspec.json.encode(await request.json(), order="sorted")
        digest = hashlib.sha256(canonical).hexdigest()
        rid = new_request_id(sub.kind)
        bound = await ctx.idempotency.claim(who_, key, rid, digest)
        if bound is not None:
            return await _again(ctx, request, body, principal, bound, digest, signer)
        try:
            rid, created, lease = await submit(ctx, sub, body.model, principal, rid)
        except BaseException:  # refused (429, 503, ...): a retry with this key may try again
            with contextlib.suppress(Exception):
                await ctx.idempotency.release(who_, key, rid)
            raise
    REQUESTS.labels(kind=str(sub.kind), stream=str(bool(body.stream)).lower()).inc()
    headers = _headers(signer, principal, rid)
    if body.stream:
        return Stream(
            sse_frames(ctx, rid, created, lease=lease),
            media_type=sse.MEDIA_TYPE,
            headers={**sse.HEADERS, **headers},
        )
    return await _collected(ctx, request, rid, created, lease, headers)


def _headers(signer: tokens.StreamTokens, principal: Principal, rid: str) -> dict[str, str]:
    """The request id, and a stream token for reading it without the API key."""
    return {REQUEST_ID_HEADER: rid, tokens.HEADER: signer.issue(principal, rid)}


def idempotency_key(request: Request[Any, Any, Any]) -> str | None:
    raw = request.headers.get(IDEMPOTENCY_HEADER)
    if raw is None:
        return None
    if not _KEY.fullmatch(raw):
        raise InvalidRequest(
            "Idempotency-Key must be 1 to 255 printable ASCII characters",
            param=IDEMPOTENCY_HEADER,
            code="invalid_idempotency_key",
        )
    return raw


async def _again(
    ctx: Context,
    request: Request[Any, Any, Any],
    body: Any,
    principal: Principal,
    bound: tuple[str, str],
    digest: str,
    signer: tokens.StreamTokens,
) -> Response[Any] | Stream:
    """A POST whose Idempotency-Key made a request already: that request again -- its
    stream from the start, or after the POST's ``Last-Event-ID`` -- or, with another
    body, a 422 (the key names one request, never two)."""
    rid, bound_digest = bound
    if bound_digest != digest:
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
    if body.stream:
        cursor = parse_cursor(request.headers.get("last-event-id"), "Last-Event-ID")
        if cursor is not None:
            _, known, last = await ctx.log.look(rid, cursor.event)
            if not known:
                raise foreign_cursor(cursor, rid, "Last-Event-ID")
            if nothing_after(rid, created, last, cursor):  # it has it all: stop
                return Response(b"", status_code=204, headers=headers)
        return Stream(
            sse_frames(ctx, rid, created, cursor),
            media_type=sse.MEDIA_TYPE,
            headers={**sse.HEADERS, **headers},
        )
    lease = await ctx.presence.acquire(rid)
    return await _collected(ctx, request, rid, created, lease, headers)


async def _collected(
    ctx: Context,
    request: Request[Any, Any, Any],
    rid: str,
    created: Created,
    lease: Lease,
    headers: dict[str, str],
) -> Response[Any]:
    agg = await until_disconnect(request, collect(ctx, rid, created, lease))
    if agg is None:  # the client went away; its lease is released, the grace period runs
        return Response(b"", status_code=499, headers=headers)
    if agg.end is not None and agg.end.state == State.ERRORED:
        err = agg.error
        content = error_object(err) if err else ApiError("the request failed").body()
        if err is not None and err.code == "log_lost":  # nothing ran to its end: send again
            return Response(content, status_code=503, headers={**headers, "Retry-After": "1"})
        return Response(content, status_code=500, headers=headers)
    return Response(agg.response(), headers=headers)


async def until_disconnect(
    request: Request[Any, Any, Any], work: Coroutine[Any, Any, T]
) -> T | None:
    """Run ``work`` unless the client disconnects first (then cancel it, return None)."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, watcher, return_exceptions=True)
    return task.result() if not task.cancelled() else None


class CompletionsController(Controller):
    path = "/v1"
    tags = ("completions",)
    request_class = JsonBodyRequest

    @post(
        "/chat/completions",
        status_code=200,
        summary="Create a chat completion",
        responses=error_responses(400, 401, 403, 413, 429, 503),
    )
    async def chat(
        self,
        ctx: Context,
        principal: Principal,
        request: Request[Any, Any, Any],
        data: ChatCompletionRequest,
    ) -> Response[Any] | Stream:
        check_model(ctx, data, principal)
        check_refused(data)
        if not data.messages:
            raise InvalidRequest("'messages' must not be empty", param="messages")
        max_tokens = data.max_completion_tokens or data.max_tokens
        sub = chat_submission(ctx, data, Kind.CHAT, max_tokens)
        return await _answer(ctx, request, data, sub, principal)

    @post(
        "/completions",
        status_code=200,
        summary="Create a text completion",
        responses=error_responses(400, 401, 403, 413, 429, 503),
    )
    async def completions(
        self,
        ctx: Context,
        principal: Principal,
        request: Request[Any, Any, Any],
        data: CompletionRequest,
    ) -> Response[Any] | Stream:
        check_model(ctx, data, principal)
        check_refused(data)
        prompt = data.prompt
        if isinstance(prompt, list) and any(isinstance(p, str) for p in prompt):
            if len(prompt) != 1 or not isinstance(prompt[0], str):
                raise InvalidRequest(
                    "'prompt' must be a string, a list with one string, or a list of token ids",
                    param="prompt",
                )
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = ctx.model.encode(prompt)
        else:
            vocab = ctx.model.tokenizer.get_vocab_size()
            bad = [t for t in prompt if not 0 <= int(t) < vocab]
            if bad:
                raise InvalidRequest(
                    f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                    param="prompt",
                )
            prompt_ids = [int(t) for t in prompt]
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", param="prompt")
        sub = submission(ctx, data, Kind.TEXT, prompt_ids, data.max_tokens, completion_output(data))
        return await _answer(ctx, request, data, sub, principal)
