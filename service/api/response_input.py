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
from service.stream import limits

SUMMARY_PREFIX = "Summary of the earlier conversation:\n"  # a compaction item as input
PHASES = ("commentary", "final_answer")  # an assistant message's ``phase`` (Open Responses)
# the parameters every response object echoes (in this order; the renderer fills defaults)
ECHOED = (
    "background",
    "frequency_penalty",
    "instructions",
    "max_output_tokens",
    "metadata",
    "parallel_tool_calls",
    "presence_penalty",
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
            # output text as the spec's OutputTextContent shows it: with its annotations
            content = [
                {"annotations": [], **c} if c.get("type") == "output_text" else c for c in content
            ]
            message = {
                "id": f"msg_{digest}",
                "type": "message",
                "role": item["role"],
                "status": "completed",
                "content": content,
            }
            if "phase" in item:
                message["phase"] = item["phase"]
            out.append(message)
        else:
            prefixes = {"function_call": "fc", "compaction": "cmp"}
            prefix = prefixes.get(item["type"], "fco")
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


# sampling fields a Responses request passes on to its chat request as they are
SAMPLING = (
    "presence_penalty",
    "frequency_penalty",
    "top_k",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "ignore_eos",
)


def chat_body(body: ResponsesRequest, items: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat-completions request (as JSON-able data) that asks the same of the model;
    ``items``: the whole input (an earlier response's, then this one's)."""
    messages: list[dict[str, Any]] = []
    if body.instructions:  # (an earlier response's instructions are not carried over)
        messages.append({"role": "system", "content": body.instructions})
    messages += _messages(items)
    out: dict[str, Any] = {"model": body.model, "messages": messages}
    for name in ("temperature", "top_p", "parallel_tool_calls", "user", *SAMPLING):
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
        elif kind == "compaction":  # a summary (compaction.py): a user turn that says so
            done = _fields(item, where, {"type", "encrypted_content", "id"}, {"encrypted_content"})
            summary = done["encrypted_content"]
            if not isinstance(summary, str):
                raise InvalidRequest(f"'{where}.encrypted_content' must be a string", param=where)
            out.append({"role": "user", "content": SUMMARY_PREFIX + summary})
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
    allowed = {"type", "role", "content", "id", "status", "phase"}
    msg = _fields(item, where, allowed, {"role", "content"})
    role = msg["role"]
    if role not in ("user", "system", "developer", "assistant"):
        raise InvalidRequest(f"'{role}' is not a message role", param=f"{where}.role")
    _check_phase(msg, where)
    content = msg["content"]
    if isinstance(content, list):
        parts = [_part(part, f"{where}.content.{j}") for j, part in enumerate(content)]
        images = any(p["type"] == "image_url" for p in parts)
        content = parts if images else "".join(p["text"] for p in parts)
    elif not isinstance(content, str):
        raise InvalidRequest("'content' must be a string or a list of parts", param=where)
    return {"role": role, "content": content}


def _part(part: Any, where: str) -> dict[str, Any]:
    """A content part as chat's: text, or an ``input_image`` as an ``image_url`` part
    (a URL; ``images.py`` checks it, and that the model sees)."""
    ptype = part.get("type") if isinstance(part, dict) else None
    if ptype in ("input_text", "output_text") and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if ptype == "input_image":
        image = _fields(part, where, {"type", "image_url", "detail", "file_id"}, {"type"})
        if image.get("file_id") is not None or not isinstance(image.get("image_url"), str):
            raise InvalidRequest(
                f"'{where}' needs 'image_url' (a data URL, or an http(s) URL); "
                "file ids are not supported by this server",
                param=f"{where}.image_url",
            )
        detail = image.get("detail")
        url = {"url": image["image_url"], **({} if detail is None else {"detail": detail})}
        return {"type": "image_url", "image_url": url}
    raise InvalidRequest(
        f"content part type '{ptype}' is not supported by this server",
        param=f"{where}.type",
        code="unsupported_parameter",
    )


def _check_phase(msg: dict[str, Any], where: str) -> None:
    """``phase`` labels an assistant message (commentary or the final answer); it stays on
    the input item (``input_items``) and, a label, is not part of the prompt."""
    if "phase" not in msg:
        return
    if msg["role"] != "assistant":
        raise InvalidRequest(
            "'phase' labels assistant messages only", param=f"{where}.phase", code="invalid_value"
        )
    if msg["phase"] not in PHASES:
        raise InvalidRequest(
            f"'{where}.phase' must be one of {PHASES}", param=f"{where}.phase", code="invalid_value"
        )


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
    _check_bounded(item, where)
    return item


def _check_bounded(item: dict[str, Any], where: str) -> None:
    """The fields of an item that are stored and templated as they are: OpenAI's shapes
    (``service/stream/limits.py``), a 400 naming the field otherwise."""
    checks = (
        ("id", limits.item_id_ok, f"1 to 128 of A-Z, a-z, 0-9, '_' and '-' ({limits.ITEM_ID})"),
        ("status", lambda v: v in limits.ITEM_STATUSES, f"one of {limits.ITEM_STATUSES}"),
        (
            "call_id",
            limits.call_id_ok,
            f"1 to {limits.MAX_CALL_ID_CHARS} printable ASCII characters without spaces",
        ),
        ("name", limits.function_name_ok, f"a function name ({limits.FUNCTION_NAME})"),
        ("arguments", lambda v: isinstance(v, str), "a string (JSON text)"),
        ("output", lambda v: isinstance(v, str), "a string"),
    )
    for field, ok, shape in checks:
        if field in item and not ok(item[field]):
            raise InvalidRequest(
                f"'{where}.{field}' must be {shape}", param=f"{where}.{field}", code="invalid_value"
            )
