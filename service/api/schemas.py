"""Public request schemas (OpenAI's field names), decoded and validated by msgspec.

The sampling fields come from ``service/stream/params.py`` (``RequestSampling``): the
struct that travels, unchanged, to the engine.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from service.stream.params import RequestSampling


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool = False
    # lastevent: how long the request survives without any reader (None: server default;
    # 0: abort as soon as the last reader leaves), or run it to the end with no reader.
    resume_grace_s: Annotated[float, Meta(ge=0.0)] | None = None
    detached: bool = False


class ContentPart(msgspec.Struct, kw_only=True):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class _Sampling(RequestSampling, kw_only=True):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: Annotated[int, Meta(ge=1)] | None = None
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None


class ChatCompletionRequest(_Sampling, kw_only=True):
    messages: list[ChatMessage]
    logprobs: bool | None = None
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None


class CompletionRequest(_Sampling, kw_only=True):
    prompt: str | list[str | int]
    logprobs: int | None = None


def message_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template expects them (text parts joined)."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if isinstance(m.content, list):
            content = "".join(p.text or "" for p in m.content if p.type == "text")
        else:
            content = m.content or ""
        out.append({"role": m.role, "content": content})
    return out


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
