"""Accepting a request: check what can be checked before the first byte, then write the
log, the caller's reader lease and the job in one step."""

from __future__ import annotations

import dataclasses
import math
import re
import secrets
import time
from collections.abc import Sequence

from service.api.auth import Principal
from service.api.context import Context
from service.api.contract import Output, chat_output, chat_prompt, check_engine
from service.api.schemas import ChatCompletionRequest, CompletionRequest
from service.errors import Forbidden, InvalidRequest, NotFound
from service.store.keys import principal as who
from service.store.presence import Lease
from service.store.queue import Job, encode_job
from service.stream.events import Created, Kind
from service.stream.ids import Cursor, InvalidEventId
from service.stream.params import SamplingParams
from service.stream.tools import ToolFormat

MAX_STOP_STRINGS = 4
MAX_STOP_LEN = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Submission:
    kind: Kind
    prompt_token_ids: list[int]
    params: SamplingParams
    include_usage: bool
    continuous_usage: bool
    resume_grace_s: float
    detached: bool
    n: int = 1
    tools: ToolFormat | None = None
    user: str | None = None
    response: bytes | None = None  # /v1/responses: the parameters its objects echo
    store: bool = True  # False: not archived, a short hot TTL


# what ``new_request_id`` issues, and so all a per-request route may look up
REQUEST_ID_RE = re.compile(r"(?:chatcmpl|cmpl)-[0-9a-f]{32}|resp_[0-9a-f]{32}")
_PREFIX = {Kind.CHAT: "chatcmpl-", Kind.TEXT: "cmpl-", Kind.RESPONSE: "resp_"}
_SHOWN_ID_CHARS = 64


def new_request_id(kind: Kind) -> str:
    """Unguessable: 128 random bits."""
    return _PREFIX[kind] + secrets.token_hex(16)


def no_such_request(request_id: str) -> NotFound:
    """The one answer for an id that never existed, another tenant's request and a
    string that is not a request id at all: nothing tells them apart."""
    shown = request_id[:_SHOWN_ID_CHARS] + ("..." if len(request_id) > _SHOWN_ID_CHARS else "")
    return NotFound(f"no request '{shown}'", param="request_id", code="not_found")


def parse_cursor(raw: str | None, param: str) -> Cursor | None:
    """A ``Last-Event-ID`` (or ``?after=``) as a cursor; empty: none; malformed: a 400."""
    if raw is None or raw == "":
        return None
    try:
        return Cursor.parse(raw)
    except InvalidEventId as exc:
        raise InvalidRequest(str(exc), param=param, code="invalid_event_id") from None


def foreign_cursor(cursor: Cursor, rid: str, param: str) -> InvalidRequest:
    """The 400 for a cursor that is not an event of this request."""
    return InvalidRequest(
        f"event id '{cursor}' is not an event of request '{rid}'",
        param=param,
        code="invalid_event_id",
    )


def checked_request_id(request_id: str) -> str:
    """A path's request id, if this server could have issued it; otherwise the unknown
    id's 404. Call it before the first lookup: the stores must never see anything else
    (Postgres rejects a NUL in a text parameter, which would be a 500)."""
    if REQUEST_ID_RE.fullmatch(request_id) is None:
        raise no_such_request(request_id)
    return request_id


def check_model(
    ctx: Context, body: ChatCompletionRequest | CompletionRequest, principal: Principal
) -> None:
    if body.model != ctx.model.name:
        raise InvalidRequest(
            f"the model '{body.model}' does not exist; this server serves '{ctx.model.name}'",
            param="model",
            code="model_not_found",
        )
    if not principal.may_use(body.model):
        raise Forbidden(
            f"this API key may not use the model '{body.model}'",
            param="model",
            code="model_not_allowed",
        )


def check_stop(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(
            f"'stop' has {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed",
            param="stop",
            code="invalid_stop",
        )
    for s in stops:
        if not s:
            raise InvalidRequest("'stop' strings must not be empty", param="stop")
        if len(s) > MAX_STOP_LEN:
            raise InvalidRequest(
                f"'stop' string of {len(s)} characters; at most {MAX_STOP_LEN} are allowed",
                param="stop",
                code="invalid_stop",
            )
    return tuple(stops)


def check_max_tokens(
    requested: int | None,
    prompt_tokens: int,
    default: int,
    ctx_len: int,
    *,
    param: str = "max_tokens",
    prompt_param: str = "messages",
) -> int:
    """``param``/``prompt_param``: the fields the client sent, named in the 400."""
    room = ctx_len - prompt_tokens
    if room <= 0:
        raise InvalidRequest(
            f"the prompt has {prompt_tokens} tokens; the model's context length is {ctx_len}",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return min(room, default)
    if requested > room:
        raise InvalidRequest(
            f"{param} is {requested} but the prompt has {prompt_tokens} tokens and the "
            f"model's context length is {ctx_len} (at most {room} tokens can be generated)",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def submission(
    ctx: Context,
    body: ChatCompletionRequest | CompletionRequest,
    kind: Kind,
    prompt_ids: list[int],
    max_tokens: int | None,
    output: Output,
    *,
    max_param: str | None = None,
    prompt_param: str | None = None,
) -> Submission:
    """``max_param`` / ``prompt_param``: the client's names of the two, when the body is
    a translation (``/v1/responses``'s ``max_output_tokens``, ``input``)."""
    settings = ctx.settings
    ctx_len = min(ctx.model.max_model_len, settings.max_model_len)
    options = body.stream_options
    grace = settings.resume_grace_s
    if options is not None and options.resume_grace_s is not None:
        grace = options.resume_grace_s
        if not math.isfinite(grace) or grace > settings.max_resume_grace_s:
            raise InvalidRequest(
                f"stream_options.resume_grace_s is {grace:g}; at most "
                f"{settings.max_resume_grace_s:g} seconds are allowed",
                param="stream_options.resume_grace_s",
            )
    params = SamplingParams.from_request(
        body,
        max_tokens=check_max_tokens(
            max_tokens,
            len(prompt_ids),
            settings.default_max_tokens,
            ctx_len,
            param=max_param
            or (
                "max_completion_tokens"
                if getattr(body, "max_completion_tokens", None) is not None
                else "max_tokens"
            ),
            prompt_param=prompt_param or ("messages" if kind == Kind.CHAT else "prompt"),
        ),
        stop=check_stop(body.stop),
        logprobs=output.logprobs,
        structured=output.structured,
    )
    check_engine(settings.engine, params)
    return Submission(
        kind=kind,
        prompt_token_ids=prompt_ids,
        params=params,
        include_usage=bool(options and options.include_usage),
        continuous_usage=bool(options and options.include_usage and options.continuous_usage_stats),
        resume_grace_s=grace,
        detached=bool(options and options.detached),
        n=body.n or 1,
        tools=output.tools,
        user=body.user,
    )


def chat_submission(
    ctx: Context,
    body: ChatCompletionRequest,
    kind: Kind,
    max_tokens: int | None,
    *,
    max_param: str | None = None,
    prompt_param: str = "messages",
) -> Submission:
    """A chat request (a chat completion, or what a response asks for) checked, its
    output resolved and its conversation rendered; ``max_param`` / ``prompt_param``: the
    client's names of the two, in the 400s. (The caller has checked the model.)"""
    output = chat_output(body, ctx.model, ctx.settings.tool_parser)
    try:
        text = chat_prompt(ctx.model, body)
    except Exception as exc:  # noqa: BLE001 - the template rejects the conversation
        raise InvalidRequest(f"invalid {prompt_param}: {exc}", param=prompt_param) from None
    return submission(
        ctx,
        body,
        kind,
        ctx.model.encode(text),
        max_tokens,
        output,
        max_param=max_param,
        prompt_param=prompt_param,
    )


async def submit(
    ctx: Context,
    sub: Submission,
    model_name: str,
    principal: Principal,
    request_id: str | None = None,
) -> tuple[str, Created, Lease]:
    """Create the log (``created`` event), take the caller's reader lease, enqueue the job.

    The lease exists before any worker can see the job, so a worker never mistakes a
    request whose client is still connecting for an abandoned one."""
    rid = request_id or new_request_id(sub.kind)
    await ctx.admission.check_capacity(len(ctx.presence))
    await ctx.admission.admit(who(principal.tenant, principal.key_id), rid)
    created = Created(
        kind=str(sub.kind),
        model=model_name,
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
    )
    settings = ctx.settings
    safety_ttl_s = int(settings.hot_log_ttl_s + 2 * settings.request_deadline_s)
    job = Job(
        request_id=rid,
        prompt_token_ids=sub.prompt_token_ids,
        params=sub.params,
        deadline_unix_s=time.time() + settings.request_deadline_s,
        n=sub.n,
        tools=sub.tools,
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
