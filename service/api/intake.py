"""The API's request boundary: an HTTP request in, a validated ``Submission`` (or a 4xx
naming what is wrong) out -- for chat completions, text completions and the Responses
API alike -- and the other things a request brings: its body as JSON, request ids in
paths, read cursors (``Last-Event-ID``, ``?after=``, ``starting_after``) and an
``Idempotency-Key``.

Everything decidable before the first byte is decided here: the schema (``schemas.py``:
strict, refused fields), the model, the contract beyond the schema (``contract.py``:
stop strings, the token budget, tools, structured output, logprobs), what the
configured engine can honour. Routes call this and ``submit.py``; nothing here writes.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import re
from typing import Any

import msgspec
from litestar import Request

from service.api import images, sizes
from service.api.auth import Principal
from service.api.context import Context
from service.api.contract import (
    Output,
    chat_output,
    chat_prompt,
    check_engine,
    check_max_tokens,
    check_refused,
    check_stop,
    completion_output,
    conversation,
)
from service.api.rendering import weight
from service.api.response_input import chat_body, check, input_items, stored
from service.api.response_log import earlier_items
from service.api.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    ResponsesRequest,
)
from service.errors import Forbidden, InvalidRequest
from service.stream.events import Kind
from service.stream.ids import Cursor, InvalidEventId
from service.stream.params import SamplingParams
from service.stream.tools import ToolFormat
from service.tokenize import ModelInfo

IDEMPOTENCY_HEADER = "Idempotency-Key"
_KEY = re.compile(r"[\x21-\x7e]{1,255}")

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


# -- read cursors --------------------------------------------------------------------


def _cursor_text(
    request: Request[Any, Any, Any], query: str | int | None, param: str
) -> tuple[str | None, str]:
    """Where a reader asks to resume, and the name to give in a 400: the
    ``Last-Event-ID`` header (what ``EventSource`` sends), else the query's ``param``."""
    header = request.headers.get("last-event-id")
    if header:
        return header, "Last-Event-ID"
    return (None if query is None else str(query)), param


def event_cursor(
    request: Request[Any, Any, Any], query: str | None = None, param: str = "after"
) -> tuple[Cursor | None, str]:
    """A chat or completion stream's cursor (an event id, with a frame index where an
    event was partly sent): ``Last-Event-ID`` or ``?after=``; empty: none; malformed: a
    400 ``invalid_event_id``. With it, the parameter it came from."""
    raw, name = _cursor_text(request, query, param)
    if not raw:
        return None, name
    try:
        return Cursor.parse(raw), name
    except InvalidEventId as exc:
        raise InvalidRequest(str(exc), param=name, code="invalid_event_id") from None


def sequence_cursor(
    request: Request[Any, Any, Any], starting_after: int | None = None
) -> int | None:
    """A Responses stream's cursor: its frames carry ``id: <sequence_number>``, so
    ``Last-Event-ID`` is a ``starting_after``."""
    raw, name = _cursor_text(request, starting_after, "starting_after")
    if raw is None or raw == "":
        return None
    # (ASCII digits only -- "²" is a digit to isdigit, not to int -- and at most 18 of
    # them: int() refuses over 4,300, a 500 it was)
    if not (raw.isascii() and raw.isdigit()) or len(raw) > 18:
        raise InvalidRequest(
            f"{name} of a response stream is a sequence number (0 or more, 18 digits at most)",
            param=name,
            code="invalid_event_id",
        )
    return int(raw)


def foreign_cursor(cursor: Cursor, rid: str, param: str) -> InvalidRequest:
    """The 400 for a cursor that is not an event of this request."""
    return InvalidRequest(
        f"event id '{cursor}' is not an event of request '{rid}'",
        param=param,
        code="invalid_event_id",
    )


# -- idempotency ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Idempotency:
    """An ``Idempotency-Key`` and the digest of the body it came with: the same key with
    the same body is the same request; with another body, a 422."""

    key: str
    digest: str


async def idempotency(request: Request[Any, Any, Any]) -> Idempotency | None:
    raw = request.headers.get(IDEMPOTENCY_HEADER)
    if raw is None:
        return None
    if not _KEY.fullmatch(raw):
        raise InvalidRequest(
            "Idempotency-Key must be 1 to 255 printable ASCII characters",
            param=IDEMPOTENCY_HEADER,
            code="invalid_idempotency_key",
        )
    # the body's JSON, not its bytes: a retry may space or order it another way
    canonical = msgspec.json.encode(await request.json(), order="sorted")
    return Idempotency(raw, hashlib.sha256(canonical).hexdigest())


# -- submissions ---------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, slots=True)
class Submission:
    """A request checked and resolved: what ``submit.py`` writes (the log's ``created``
    and the worker's job)."""

    kind: Kind
    model: str
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
    input: bytes | None = None  # the request body as JSON, when it is kept (``kept_input``)
    metadata: dict[str, str] | None = None
    listed: bool = False  # a stored chat completion (``store: true``)
    conversation: bytes = b""  # for a text-mode upstream (``Job.conversation``)
    images: tuple[bytes, ...] = ()  # the prompt's images, in order (``Job.images``)


def check_model(ctx: Context, name: str | None, principal: Principal) -> ModelInfo:
    """A model this process knows (``None``: its default), that the key may use: its
    tokenizer and template (an adapter's are its base's, under the adapter's name). A
    model no worker serves now is admission's 503, not this."""
    model = ctx.catalog.info(name)
    if not principal.may_use(model.name):
        raise Forbidden(
            f"this API key may not use the model '{model.name}'",
            param="model",
            code="model_not_allowed",
        )
    return model


def _checked(
    ctx: Context, body: ChatCompletionRequest | CompletionRequest, p: Principal
) -> ModelInfo:
    model = check_model(ctx, body.model, p)
    check_refused(body)
    return model


async def chat(ctx: Context, body: ChatCompletionRequest, principal: Principal) -> Submission:
    """``POST /v1/chat/completions``."""
    model = _checked(ctx, body, principal)
    if not body.messages:
        raise InvalidRequest("'messages' must not be empty", param="messages")
    sizes.check_chat(body)
    pictures = await images.resolve(ctx, images.in_messages(body.messages), model.name)
    sub = await _chat(ctx, model, body, Kind.CHAT, body.max_completion_tokens or body.max_tokens)
    return kept_input(ctx, body, principal, dataclasses.replace(sub, images=pictures))


def kept_input(
    ctx: Context,
    body: ChatCompletionRequest | CompletionRequest,
    principal: Principal,
    sub: Submission,
) -> Submission:
    """What is kept of the request beside its answer: its ``metadata`` always; the body
    itself (messages or prompt, tools, parameters) when the client sent ``store: true`` or
    an operator keeps every input (the server's ``keep_inputs``, or the tenant's). Only a
    chat completion sent with ``store: true`` is listed (OpenAI's stored completions)."""
    keep = body.store is True or ctx.settings.keep_inputs or principal.keep_inputs
    return dataclasses.replace(
        sub,
        input=msgspec.json.encode(body) if keep else None,
        metadata=body.metadata,
        listed=body.store is True and sub.kind == Kind.CHAT,
    )


async def completion(ctx: Context, body: CompletionRequest, principal: Principal) -> Submission:
    """``POST /v1/completions``: a prompt as text, a list with one text, or token ids."""
    model = _checked(ctx, body, principal)
    prompt = body.prompt
    if isinstance(prompt, list) and any(isinstance(p, str) for p in prompt):
        if len(prompt) != 1 or not isinstance(prompt[0], str):
            raise InvalidRequest(
                "'prompt' must be a string, a list with one string, or a list of token ids",
                param="prompt",
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        prompt_ids = await ctx.renderer.run(len(prompt), functools.partial(model.encode, prompt))
    else:
        vocab = model.tokenizer.get_vocab_size()
        bad = [t for t in prompt if not 0 <= int(t) < vocab]
        if bad:
            raise InvalidRequest(
                f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", param="prompt"
            )
        prompt_ids = [int(t) for t in prompt]
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", param="prompt")
    output = completion_output(body)
    sub = _submission(ctx, model, body, Kind.TEXT, prompt_ids, body.max_tokens, output)
    return kept_input(ctx, body, principal, sub)


async def response(ctx: Context, body: ResponsesRequest, principal: Principal) -> Submission:
    """``POST /v1/responses``: the chat request it asks for (after the conversation of its
    ``previous_response_id``), run detached in ``background`` mode (it runs to its end
    with no reader), not archived for ``store: false``."""
    check(body)
    sizes.check_response(body)
    items = input_items(body)
    own_from = 0
    if body.previous_response_id is not None:
        earlier = await earlier_items(ctx, principal, body.previous_response_id)
        items, own_from = earlier + items, len(earlier)
        sizes.check_chain(items, ctx.settings.max_body_bytes)
    try:
        chat_request = msgspec.convert(chat_body(body, items), ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid input: {exc}", param="input") from None
    model = check_model(ctx, chat_request.model, principal)
    pictures = await images.resolve(ctx, images.in_items(items, own_from), model.name)
    sub = await _chat(
        ctx,
        model,
        chat_request,
        Kind.RESPONSE,
        body.max_output_tokens,
        max_param="max_output_tokens",
        prompt_param="input",
    )
    return dataclasses.replace(
        sub,
        response=stored(body, items),
        detached=body.background,
        store=body.store is not False,
        metadata=body.metadata,
        images=pictures,
    )


async def _chat(
    ctx: Context,
    model: ModelInfo,
    body: ChatCompletionRequest,
    kind: Kind,
    max_tokens: int | None,
    *,
    max_param: str | None = None,
    prompt_param: str = "messages",
) -> Submission:
    """A chat request (a chat completion, or what a response asks for): its output
    resolved and its conversation rendered; ``max_param`` / ``prompt_param``: the
    client's names of the two, in the 400s."""
    output = chat_output(body, model, ctx.settings.tool_parser)
    sizes.check_grammar(output.structured, body, responses=prompt_param == "input")

    def render() -> list[int]:
        try:
            text = chat_prompt(model, body)
        except Exception as exc:  # noqa: BLE001 - the template rejects the conversation
            raise InvalidRequest(f"invalid {prompt_param}: {exc}", param=prompt_param) from None
        return model.encode(text)

    prompt_ids = await ctx.renderer.run(weight(body.messages), render)
    return _submission(
        ctx,
        model,
        body,
        kind,
        prompt_ids,
        max_tokens,
        output,
        max_param=max_param,
        prompt_param=prompt_param,
    )


def _submission(
    ctx: Context,
    model: ModelInfo,
    body: ChatCompletionRequest | CompletionRequest,
    kind: Kind,
    prompt_ids: list[int],
    max_tokens: int | None,
    output: Output,
    *,
    max_param: str | None = None,
    prompt_param: str | None = None,
) -> Submission:
    settings = ctx.settings
    options = body.stream_options
    grace = settings.resume_window
    if options is not None and options.resume_grace_s is not None:
        grace = options.resume_grace_s
        if not math.isfinite(grace) or grace > settings.max_resume_grace_s:
            raise InvalidRequest(
                f"stream_options.resume_grace_s is {grace:g}; at most "
                f"{settings.max_resume_grace_s:g} seconds are allowed",
                param="stream_options.resume_grace_s",
            )
    if max_param is None:
        completion_max = getattr(body, "max_completion_tokens", None) is not None
        max_param = "max_completion_tokens" if completion_max else "max_tokens"
    budget = check_max_tokens(
        max_tokens,
        len(prompt_ids),
        settings.default_max_tokens,
        ctx.context_length(model),
        param=max_param,
        prompt_param=prompt_param or ("messages" if kind == Kind.CHAT else "prompt"),
    )
    params = SamplingParams.from_request(
        body,
        max_tokens=budget,
        stop=check_stop(body.stop),
        logprobs=output.logprobs,
        structured=output.structured,
    )
    engine = ctx.catalog.engine_of(model.name) or settings.engine
    check_engine(engine, params)
    return Submission(
        kind=kind,
        model=model.name,
        prompt_token_ids=prompt_ids,
        params=params,
        include_usage=bool(options and options.include_usage),
        continuous_usage=bool(options and options.include_usage and options.continuous_usage_stats),
        resume_grace_s=grace,
        detached=bool(options and options.detached),
        n=body.n or 1,
        tools=output.tools,
        user=body.user,
        conversation=conversation(engine, body, output),
    )
