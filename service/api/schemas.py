"""Public request schemas (OpenAI's field names), decoded and validated by msgspec:
chat completions, text completions and the Responses API.

Every request object is strict: a field it does not declare is a 400 naming it. An
OpenAI field that no engine here can honour is declared ``Refused``: accepted as null,
a 400 naming it otherwise (``refused_field``), never silently dropped. The sampling
fields come from ``service/stream/params.py`` (``RequestSampling``): the struct that
travels, unchanged, to the engine. ``intake.py`` is where a request is checked beyond
its schema.
"""

from __future__ import annotations

import functools
import typing
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from service.stream.limits import CALL_ID, FUNCTION_NAME, MAX_TOOL_CALLS, NAME
from service.stream.params import MAX_LOGPROBS, RequestSampling

MAX_CHOICES = 8  # n: choices of one request

# OpenAI's ``metadata``: at most 16 pairs, keys of at most 64 characters, string values
# of at most 512 (a 400 naming ``metadata`` otherwise); no NUL, which Postgres' text and
# JSONB cannot hold (the billing row keeps the metadata and the ``user``)
MAX_METADATA_PAIRS = 16
_NO_NUL = "^[^\x00]*$"
Metadata = Annotated[
    dict[
        Annotated[str, Meta(max_length=64, pattern=_NO_NUL)],
        Annotated[str, Meta(max_length=512, pattern=_NO_NUL)],
    ],
    Meta(max_length=MAX_METADATA_PAIRS),
]


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A request object: a field it does not declare is a 400 naming it."""


class _RefusedMarker:
    """``Refused``'s mark (see ``refused_field``)."""


# an OpenAI field no engine here can honour: accepted only as null
Refused = Annotated[Any, _RefusedMarker]


class StreamOptions(_Strict, kw_only=True):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (GuideLLM sends it)
    continuous_usage_stats: bool = False
    # lastevent: how long the request survives without any reader (None: server default;
    # 0: abort as soon as the last reader leaves), or run it to the end with no reader.
    resume_grace_s: Annotated[float, Meta(ge=0.0)] | None = None
    detached: bool = False


class TextPart(_Strict, kw_only=True, tag_field="type", tag="text"):
    text: str


class ImageUrl(_Strict, kw_only=True):
    url: Annotated[str, Meta(min_length=1)]  # a data: URL, or http(s) (``stream/images.py``)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(_Strict, kw_only=True, tag_field="type", tag="image_url"):
    """An image, for a model whose worker declares it sees (a 400 naming the model
    otherwise: ``images.py``); audio and files: no model here reads them."""

    image_url: ImageUrl


ContentPart = TextPart | ImagePart


# a name or id that is templated and stored as it is: OpenAI's shapes (stream/limits.py)
FunctionName = Annotated[str, Meta(pattern=FUNCTION_NAME)]
CallId = Annotated[str, Meta(pattern=CALL_ID)]


class FunctionCall(_Strict, kw_only=True):
    name: FunctionName
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict, kw_only=True):
    id: CallId
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: Annotated[str, Meta(pattern=NAME)] | None = None
    # an assistant's earlier calls
    tool_calls: Annotated[list[ToolCall], Meta(max_length=MAX_TOOL_CALLS)] | None = None
    tool_call_id: CallId | None = None  # a tool's answer to one of them


class FunctionDef(_Strict, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    strict: bool | None = None


class Tool(_Strict, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict, kw_only=True):
    name: FunctionName


class NamedToolChoice(_Strict, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict, kw_only=True):
    name: Annotated[str, Meta(pattern=NAME)]
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(_Strict, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(RequestSampling, kw_only=True, forbid_unknown_fields=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None
    user: Annotated[str, Meta(max_length=256, pattern=_NO_NUL)] | None = None
    # OpenAI's stored completions: ``store: true`` keeps the request's input with its
    # answer and lists it (``GET /v1/chat/completions``); every answer is kept in the log
    # and archived whatever ``store`` says (resume and replay are made of it)
    store: bool | None = None
    metadata: Metadata | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    audio: Refused = None
    function_call: Refused = None
    functions: Refused = None
    modalities: Refused = None
    prediction: Refused = None
    reasoning_effort: Refused = None
    service_tier: Refused = None
    web_search_options: Refused = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[str | int]
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Refused = None
    echo: Refused = None
    suffix: Refused = None
    service_tier: Refused = None


# /v1/responses (OpenAI's Responses API; ``response_input.py`` turns it into a chat request)


class FunctionTool(FunctionDef, kw_only=True):
    """A Responses tool: chat's function, flat, with its ``type``."""

    type: Literal["function"]


class NamedTool(_Strict, kw_only=True):
    type: Literal["function"]
    name: FunctionName


class TextFormat(_Strict, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Meta(pattern=NAME)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class TextOptions(_Strict, kw_only=True):
    format: TextFormat | None = None


class ResponsesRequest(_Strict, kw_only=True):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2.0, le=2.0)] | None = None
    # vLLM's extensions of the Responses request (its own server takes them too; `vllm
    # bench serve` sends ignore_eos): passed on as a chat request's, never echoed
    top_k: Annotated[int, Meta(ge=-1)] | None = None
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] | None = None
    seed: Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)] | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextOptions | None = None
    stream: bool = False
    background: bool = False
    store: bool | None = None
    metadata: Metadata | None = None
    previous_response_id: str | None = None
    user: Annotated[str, Meta(max_length=256, pattern=_NO_NUL)] | None = None


class MetadataUpdate(_Strict, kw_only=True):
    """``POST /v1/chat/completions/{id}``: a stored completion's new metadata (replaces it)."""

    metadata: Metadata | None


def refused_field(body: msgspec.Struct) -> str | None:
    """The first OpenAI field ``body`` sets that lastevent cannot honour."""
    for name in refused_fields(type(body)):
        if getattr(body, name, None) is not None:
            return name
    return None


@functools.cache
def refused_fields(struct: type[msgspec.Struct]) -> tuple[str, ...]:
    """The fields ``struct`` declares ``Refused``."""
    hints = typing.get_type_hints(struct, include_extras=True)
    return tuple(n for n, t in hints.items() if _RefusedMarker in getattr(t, "__metadata__", ()))


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as Hugging Face chat templates expect them: text parts joined, a tool
    call's arguments as an object (templates write them with ``tojson``)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        content: str | list[dict[str, str]]
        if isinstance(m.content, list) and any(isinstance(p, ImagePart) for p in m.content):
            # Hugging Face's parts: a template puts its image placeholder for each image
            content = [
                {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
                for p in m.content
            ]
        elif isinstance(m.content, list):
            content = "".join(p.text for p in m.content if isinstance(p, TextPart))
        else:
            content = m.content or ""
        d: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c)},
                }
                for c in m.tool_calls
            ]
        out.append(d)
    return out


def _arguments(call: ToolCall) -> Any:
    try:
        return msgspec.json.decode(call.function.arguments)
    except msgspec.DecodeError:
        return call.function.arguments  # a template that writes strings as they are


class ErrorDetail(msgspec.Struct, kw_only=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, kw_only=True):
    """Every error status answers this (OpenAI's error object)."""

    error: ErrorDetail


def error_responses(*statuses: int) -> dict[int, Any]:
    """OpenAPI entries for the error statuses a route can answer."""
    from litestar.openapi.datastructures import ResponseSpec

    text = {
        400: "Invalid request: names the parameter, the limit and the observed value",
        401: "Missing or invalid API key",
        403: "The key may not use this model or route",
        404: "No such request (another tenant's request looks the same), or model",
        413: "Body over the size limit",
        422: "The Idempotency-Key was used with another request body",
        429: "The key is over its limits (see Retry-After)",
        503: "Over capacity or no worker available (see Retry-After)",
    }
    return {s: ResponseSpec(data_container=ErrorResponse, description=text[s]) for s in statuses}
