"""Public request schemas (OpenAI's field names), decoded and validated by msgspec.

The sampling fields come from ``service/stream/params.py`` (``RequestSampling``): the
struct that travels, unchanged, to the engine.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from service.stream.params import MAX_LOGPROBS, RequestSampling

MAX_CHOICES = 8  # n: choices of one request


class _Strict(msgspec.Struct, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    """A request object: a field it does not declare is a 400 naming it."""


class StreamOptions(_Strict, kw_only=True):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (GuideLLM sends it)
    continuous_usage_stats: bool = False
    # lastevent: how long the request survives without any reader (None: server default;
    # 0: abort as soon as the last reader leaves), or run it to the end with no reader.
    resume_grace_s: Annotated[float, Meta(ge=0.0)] | None = None
    detached: bool = False


class ContentPart(_Strict, kw_only=True):
    type: Literal["text"]  # images, audio and files: no model here reads them
    text: str


class FunctionCall(_Strict, kw_only=True):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(_Strict, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict, kw_only=True):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one of them


class FunctionDef(_Strict, kw_only=True):
    name: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema
    strict: bool | None = None


class Tool(_Strict, kw_only=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict, kw_only=True):
    name: str


class NamedToolChoice(_Strict, kw_only=True):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict, kw_only=True):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = msgspec.field(default=None, name="schema")
    strict: bool | None = None


class ResponseFormat(_Strict, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


# OpenAI fields that no engine here can honour: accepted as null, a 400 naming them
# otherwise (never silently dropped)
REFUSED_FIELDS = (
    "audio",
    "function_call",
    "functions",
    "modalities",
    "prediction",
    "reasoning_effort",
    "service_tier",
    "web_search_options",
    "metadata",
    "best_of",
    "echo",
    "suffix",
)


class _Sampling(RequestSampling, kw_only=True, forbid_unknown_fields=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    stop: str | list[str] | None = None
    n: Annotated[int, Meta(ge=1, le=MAX_CHOICES)] | None = None
    user: Annotated[str, Meta(max_length=256)] | None = None
    # OpenAI's: every answer is kept in the log whatever ``store`` says (resume and replay
    # are made of it); ``metadata`` is not kept anywhere, so it is refused
    store: bool | None = None
    metadata: Any = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    audio: Any = None
    function_call: Any = None
    functions: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    service_tier: Any = None
    web_search_options: Any = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[str | int]
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    best_of: Any = None
    echo: Any = None
    suffix: Any = None
    service_tier: Any = None


def refused_field(body: msgspec.Struct) -> str | None:
    """The first OpenAI field ``body`` sets that lastevent cannot honour."""
    for name in REFUSED_FIELDS:
        if getattr(body, name, None) is not None:
            return name
    return None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as Hugging Face chat templates expect them: text parts joined, a tool
    call's arguments as an object (templates write them with ``tojson``)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m.content, list):
            content = "".join(p.text for p in m.content)
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
        404: "No such request (another tenant's request looks the same)",
        413: "Body over the size limit",
        429: "The key is over its limits (see Retry-After)",
        503: "Over capacity or no worker available (see Retry-After)",
    }
    return {s: ResponseSpec(data_container=ErrorResponse, description=text[s]) for s in statuses}
