"""The sizes of a request, checked before any chat template, tokenizer or grammar
compiler sees it (the bounds: ``service/stream/limits.py``): a 400 naming the field.

What is templated and what is stored are the same things here: a chat request's
messages and tools, a response's input items (a ``previous_response_id`` chain's,
accumulated, included), tools and output schema.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from service.api.schemas import ChatCompletionRequest, ResponsesRequest
from service.errors import InvalidRequest
from service.stream.limits import (
    MAX_GRAMMAR_BYTES,
    MAX_MESSAGES,
    MAX_SCHEMA_BYTES,
    MAX_TOOL_BYTES,
    MAX_TOOLS,
)
from service.stream.params import Structured


def check_count(param: str, count: int, limit: int = MAX_MESSAGES) -> None:
    if count > limit:
        raise InvalidRequest(
            f"'{param}' has {count} entries; at most {limit} are allowed",
            param=param,
            code="too_many_entries",
        )


def check_bytes(param: str, value: Any, limit: int) -> None:
    """``value`` as JSON (what is stored and compiled) within ``limit`` bytes."""
    size = len(msgspec.json.encode(value))
    if size > limit:
        raise InvalidRequest(
            f"'{param}' is {size} bytes as JSON; at most {limit} are allowed",
            param=param,
            code="too_large",
        )


def check_tools(tools: Sequence[msgspec.Struct] | None) -> None:
    if not tools:
        return
    check_count("tools", len(tools), MAX_TOOLS)
    for i, tool in enumerate(tools):
        check_bytes(f"tools.{i}", tool, MAX_TOOL_BYTES)


def check_chat(body: ChatCompletionRequest) -> None:
    """A chat completion's (and /tokenize's) messages and tools, and its output schema."""
    check_count("messages", len(body.messages))
    check_tools(body.tools)
    fmt = body.response_format
    if fmt is not None and fmt.json_schema is not None and fmt.json_schema.schema_ is not None:
        check_bytes("response_format.json_schema.schema", fmt.json_schema.schema_, MAX_SCHEMA_BYTES)


def check_response(body: ResponsesRequest) -> None:
    """A response's own input items, tools and output schema (its chain: ``check_chain``)."""
    if isinstance(body.input, list):
        check_count("input", len(body.input))
    check_tools(body.tools)
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.schema_ is not None:
        check_bytes("text.format.schema", fmt.schema_, MAX_SCHEMA_BYTES)


def check_chain(items: list[dict[str, Any]], max_body_bytes: int) -> None:
    """The input a ``previous_response_id`` chain has accumulated (the earlier turns'
    input and output, then this one's): stored whole with this turn and templated whole,
    so bounded as if it had been sent in one body."""
    param = "previous_response_id"
    if len(items) > MAX_MESSAGES:
        raise InvalidRequest(
            f"the conversation of '{param}' with this input has {len(items)} items; at most "
            f"{MAX_MESSAGES} are allowed: start a new conversation",
            param=param,
            code="conversation_too_large",
        )
    size = len(msgspec.json.encode(items))
    if size > max_body_bytes:
        raise InvalidRequest(
            f"the conversation of '{param}' with this input is {size} bytes as JSON; at most "
            f"{max_body_bytes} (the body's bound) are allowed: start a new conversation",
            param=param,
            code="conversation_too_large",
        )


def check_grammar(
    structured: Structured | None, body: ChatCompletionRequest, *, responses: bool = False
) -> None:
    """The grammar an engine will compile (a forced tool_choice's is every tool's
    parameters together); ``responses``: named as the Responses API names its fields."""
    if structured is None or structured.schema is None:
        return
    size = len(structured.schema.encode())
    if size > MAX_GRAMMAR_BYTES:
        param = "tools"
        if body.response_format is not None and body.response_format.type != "text":
            param = "text.format" if responses else "response_format"
        raise InvalidRequest(
            f"the output grammar of '{param}' is {size} bytes; at most "
            f"{MAX_GRAMMAR_BYTES} are allowed",
            param=param,
            code="too_large",
        )
