"""The request's side of tool calling: which format a model family writes its calls in
(from its chat template), the system text that offers tools to a template that cannot,
and the JSON Schema a forced ``tool_choice`` constrains decoding to. The output's side
-- the parsers -- is ``tools.py``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from service.stream.tools import CALL_END, CALL_START, PYTHON_TAG


def detect_format(chat_template: str) -> str:
    """The model family's format, from its chat template ("hermes" when unsure)."""
    if CALL_START in chat_template:
        return "hermes"
    if PYTHON_TAG in chat_template:
        return "llama3_json"
    if "<|start_header_id|>" in chat_template and (
        "tool" in chat_template or "parameters" in chat_template
    ):
        return "llama3_json"
    return "hermes"


def _function(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool.get("function", tool)
    return function if isinstance(function, dict) else {}


def tool_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """A Hermes-style system text listing ``tools``, for a chat template that does not
    render ``tools`` itself."""
    listed = "\n".join(msgspec.json.encode(_function(tool)).decode() for tool in tools)
    return (
        "You may call functions to answer the user. Each function you can call is "
        "described by one JSON object per line between <tools> and </tools>:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "To call a function, reply with this block, one block per call:\n"
        f'{CALL_START}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n'
        f"{CALL_END}\n"
        "Put nothing else inside a block. When no function helps, answer in plain text."
    )


def forced_schema(tools: Sequence[dict[str, Any]], choice: str | None) -> dict[str, Any]:
    """The JSON Schema constrained decoding uses for a forced ``tool_choice``: the
    function's parameters (``choice`` names it), or (``choice`` None: "required") an
    array of at least one ``{"name": <one of them>, "parameters": <its schema>}``."""
    functions = [_function(tool) for tool in tools]

    def params(function: dict[str, Any]) -> dict[str, Any]:
        schema = function.get("parameters")
        return {"type": "object"} if schema is None else dict(schema)

    if choice is not None:
        for function in functions:
            if function.get("name") == choice:
                return params(function)
        raise ValueError(f"tool_choice names the function {choice!r}, which is not in tools")
    if not functions:
        raise ValueError('tool_choice "required" needs at least one tool')
    # "name" first: decoding writes it first, so the call's name streams before its arguments
    each = [
        {
            "type": "object",
            "properties": {"name": {"const": function.get("name")}, "parameters": params(function)},
            "required": ["name", "parameters"],
        }
        for function in functions
    ]
    return {"type": "array", "minItems": 1, "items": {"anyOf": each}}
