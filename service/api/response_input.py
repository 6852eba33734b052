"""``POST /v1/responses``: OpenAI's Responses request, checked, and turned into the chat
request the rest of the service already serves (prompt, tools, structured output).

Input items become chat messages: a string is one user message; ``message`` items keep
their role (content as a string or ``input_text`` / ``output_text`` parts); consecutive
``function_call`` items become one assistant message with ``tool_calls``; a
``function_call_output`` becomes a ``tool`` message. ``instructions`` is the system
message. Function tools are flat here (``{"type": "function", "name", ...}``) and
nested in chat; ``text.format`` is chat's ``response_format``.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec

from service.api.schemas import NamedTool, ResponsesRequest
from service.errors import InvalidRequest

# the parameters every response object echoes (in this order; the renderer fills defaults)
ECHOED = (
    "background",
    "instructions",
    "max_output_tokens",
    "metadata",
    "parallel_tool_calls",
    "previous_response_id",
    "store",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_p",
)


def stored(body: ResponsesRequest, items: list[dict[str, Any]]) -> bytes:
    """What the log keeps of the request (JSON): the parameters its response objects echo,
    and its input items (``previous_response_id`` expanded), which ``input_items`` lists
    and a later ``previous_response_id`` continues from -- from the archive too."""
    plain = msgspec.to_builtins(body)
    params = {k: plain[k] for k in ECHOED if k in plain}
    return msgspec.json.encode({"params": params, "input": items})


def kept(raw: bytes | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """``stored``'s two parts back."""
    data = msgspec.json.decode(raw) if raw else {}
    return data.get("params", {}), data.get("input", [])


def input_items(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input as a list of items (a string is one user message)."""
    if isinstance(body.input, str):
        return [{"type": "message", "role": "user", "content": body.input}]
    return list(body.input)


def as_input(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output items as input items of the next turn."""
    out = []
    for item in output:
        if item.get("type") == "message":
            text = "".join(p.get("text", "") for p in item.get("content", []))
            out.append({"type": "message", "role": "assistant", "content": text})
        elif item.get("type") == "function_call":
            out.append({k: item[k] for k in ("type", "call_id", "name", "arguments")})
    return out


def listed(rid: str, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Input items as ``GET .../input_items`` lists them: each with an id, messages with
    content parts."""
    out = []
    for i, item in enumerate(items):
        digest = hashlib.sha256(f"{rid}/input/{i}".encode()).hexdigest()[:48]
        if item.get("type", "message") == "message":
            content = item["content"]
            if isinstance(content, str):
                kind = "output_text" if item["role"] == "assistant" else "input_text"
                content = [{"type": kind, "text": content}]
            out.append(
                {
                    "id": f"msg_{digest}",
                    "type": "message",
                    "role": item["role"],
                    "status": "completed",
                    "content": content,
                }
            )
        else:
            prefix = "fc" if item["type"] == "function_call" else "fco"
            out.append({"id": f"{prefix}_{digest}", "status": "completed", **item})
    return out


def check(body: ResponsesRequest) -> None:
    """What this server cannot honour yet: a 400 naming it."""
    if isinstance(body.input, list) and not body.input:
        raise InvalidRequest("'input' must not be empty", param="input")
    if body.store is False and body.background:
        raise InvalidRequest(
            "background mode needs 'store': true (its answer is read back later)",
            param="store",
        )
    if body.metadata is not None and len(body.metadata) > 16:
        raise InvalidRequest("'metadata' has more than 16 keys", param="metadata")


def chat_body(body: ResponsesRequest, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions request (as JSON-able data) that asks the same of the model;
    ``items``: the whole input (an earlier response's, then this one's)."""
    messages: list[dict[str, Any]] = []
    if body.instructions:  # (an earlier response's instructions are not carried over)
        messages.append({"role": "system", "content": body.instructions})
    messages += _messages(items)
    out: dict[str, Any] = {"model": body.model, "messages": messages}
    for name in ("temperature", "top_p", "parallel_tool_calls", "user"):
        value = getattr(body, name)
        if value is not None:
            out[name] = value
    if body.max_output_tokens is not None:
        out["max_completion_tokens"] = body.max_output_tokens
    if body.tools:
        out["tools"] = [
            {
                "type": "function",
                "function": {
                    k: v
                    for k, v in msgspec.to_builtins(t).items()
                    if k in ("name", "description", "parameters", "strict")
                },
            }
            for t in body.tools
        ]
    if isinstance(body.tool_choice, NamedTool):
        out["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        out["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        schema = {"name": fmt.name or "response", "schema": fmt.schema_ or {}}
        out["response_format"] = {"type": "json_schema", "json_schema": schema}
    elif fmt is not None and fmt.type == "json_object":
        out["response_format"] = {"type": "json_object"}
    return out


def _messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input.{i}"
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call":
            call = _fields(item, where, {"type", "call_id", "name", "arguments", "id", "status"})
            tool_call = {
                "id": call["call_id"],
                "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]},
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_calls" in last:
                last["tool_calls"].append(tool_call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [tool_call]})
        elif kind == "function_call_output":
            done = _fields(item, where, {"type", "call_id", "output", "id", "status"})
            out.append({"role": "tool", "tool_call_id": done["call_id"], "content": done["output"]})
        else:
            raise InvalidRequest(
                f"input item type '{kind}' is not supported by this server",
                param=f"{where}.type",
                code="unsupported_parameter",
            )
    return out


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    msg = _fields(item, where, {"type", "role", "content", "id", "status"}, {"role", "content"})
    role = msg["role"]
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(f"'{role}' is not a message role", param=f"{where}.role")
    content = msg["content"]
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            ptype = part.get("type") if isinstance(part, dict) else None
            if ptype not in ("input_text", "output_text") or not isinstance(part.get("text"), str):
                raise InvalidRequest(
                    f"content part type '{ptype}' is not supported by this server",
                    param=f"{where}.content.{j}.type",
                    code="unsupported_parameter",
                )
            texts.append(part["text"])
        content = "".join(texts)
    elif not isinstance(content, str):
        raise InvalidRequest("'content' must be a string or a list of parts", param=where)
    return {"role": role, "content": content}


def _fields(
    item: dict[str, Any], where: str, allowed: set[str], required: set[str] | None = None
) -> dict[str, Any]:
    unknown = sorted(set(item) - allowed)
    if unknown:
        raise InvalidRequest(
            f"Unrecognized request argument supplied: {where}.{unknown[0]}",
            param=f"{where}.{unknown[0]}",
        )
    needed = required if required is not None else allowed - {"id", "status"}
    missing = sorted(needed - set(item))
    if missing:
        raise InvalidRequest(f"'{where}' needs '{missing[0]}'", param=f"{where}.{missing[0]}")
    return item
