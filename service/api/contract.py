"""The OpenAI request contract beyond the schema: stop strings and the token budget, and
what a chat or completion body asks of the output (tool calls, structured output,
logprobs), checked and resolved before the request exists. ``intake.py`` calls these.

Everything here is a 400 that names the field when it cannot be honoured: a field
the schema does not declare (the schemas forbid them), an OpenAI field no engine here
serves (``REFUSED_FIELDS``), or a known field the configured engine cannot honour
(``service.stream.params.UNSUPPORTED``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import msgspec

from service.api.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    message_dicts,
    refused_field,
)
from service.errors import InvalidRequest
from service.settings import ToolParser
from service.stream.params import SamplingParams, Structured, unsupported
from service.stream.tool_prompts import detect_format, forced_schema, tool_system_prompt
from service.stream.tools import ToolFormat
from service.tokenize import ModelInfo

MAX_STOP_STRINGS = 4
MAX_STOP_LEN = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Output:
    """What the request asks of its output, resolved."""

    logprobs: int | None = None
    structured: Structured | None = None
    tools: ToolFormat | None = None


def check_refused(body: ChatCompletionRequest | CompletionRequest) -> None:
    name = refused_field(body)
    if name is not None:
        raise InvalidRequest(
            f"'{name}' is not supported by this server", param=name, code="unsupported_parameter"
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


def check_engine(engine: str, params: SamplingParams) -> None:
    """A 400 naming the first field ``engine`` cannot honour."""
    refused = unsupported(engine, params)
    if refused:
        raise InvalidRequest(
            f"'{refused[0]}' is not supported by the {engine} engine",
            param=refused[0],
            code="unsupported_parameter",
        )


TEXT_ENGINE = "upstream-text"  # an upstream in text mode: sent the conversation, not ids


def conversation(
    engine: str, body: ChatCompletionRequest | CompletionRequest, output: Output
) -> bytes:
    """What a text-mode upstream is sent instead of the prompt's ids (b"": another
    engine): the messages, or the prompt's text. Tools are refused there: such an
    upstream would parse calls its own way, and the log's are parsed by ours."""
    if engine != TEXT_ENGINE:
        return b""
    if output.tools is not None:
        raise InvalidRequest(
            f"'tools' are not supported by the {engine} engine",
            param="tools",
            code="unsupported_parameter",
        )
    if isinstance(body, ChatCompletionRequest):
        return msgspec.json.encode({"messages": body.messages})
    prompt = body.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidRequest(
            f"'prompt' must be text for the {engine} engine (token ids are ids of "
            "lastevent's tokenizer, not the upstream's)",
            param="prompt",
            code="unsupported_parameter",
        )
    return msgspec.json.encode({"prompt": prompt})


def chat_prompt(model: ModelInfo, body: ChatCompletionRequest) -> str:
    """The conversation through the model's chat template, with the tools the request
    offers (``tool_choice`` "none": not offered)."""
    return render_conversation(model, body.messages, offered_tools(body))


def render_conversation(
    model: ModelInfo,
    conversation: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    *,
    generation_prompt: bool = True,
) -> str:
    """What /v1/chat/completions (and /tokenize) tokenize. A template that does not render
    ``tools`` gets them in a system message, and earlier calls and tool answers as
    Hermes-style text, so that the model sees them all the same; a template that knows no
    ``developer`` role gets it as ``system``."""
    messages = message_dicts(conversation)
    if "developer" not in model.chat_template:  # OpenAI's newer name for it
        messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    if tools and "tools" not in model.chat_template:
        messages = _as_text(messages, tools)
        tools = None
    elif not tools and "tool_calls" not in model.chat_template:
        messages = _as_text(messages, None)
    return model.render_chat(messages, tools=tools, add_generation_prompt=generation_prompt)


def offered_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    if not body.tools or body.tool_choice == "none":
        return None
    return [msgspec.to_builtins(t) for t in body.tools]


def chat_output(body: ChatCompletionRequest, model: ModelInfo, parser: ToolParser) -> Output:
    """``parser``: the setting (auto: the model's family, from its chat template)."""
    logprobs = None
    if body.top_logprobs is not None and not body.logprobs:
        raise InvalidRequest(
            "'top_logprobs' needs 'logprobs': true", param="top_logprobs", code="invalid_value"
        )
    if body.logprobs:
        logprobs = body.top_logprobs or 0
    structured = response_structured(body)
    tools = None
    choice = body.tool_choice
    if choice is not None and not body.tools:
        raise InvalidRequest(
            "'tool_choice' is only allowed when 'tools' are given", param="tool_choice"
        )
    if body.parallel_tool_calls is not None and not body.tools:
        raise InvalidRequest(
            "'parallel_tool_calls' is only allowed when 'tools' are given",
            param="parallel_tool_calls",
        )
    if body.tools and choice != "none":
        names = [t.function.name for t in body.tools]
        if len(set(names)) != len(names):
            raise InvalidRequest("'tools' names a function twice", param="tools")
        parallel = body.parallel_tool_calls is not False
        offered = [msgspec.to_builtins(t) for t in body.tools]
        forced: str | None = None
        if isinstance(choice, NamedToolChoice):
            forced = choice.function.name
            if forced not in names:
                raise InvalidRequest(
                    f"tool_choice names the function '{forced}', which 'tools' does not offer",
                    param="tool_choice",
                )
            tools = ToolFormat("named", forced, parallel=False)
        elif choice == "required":
            tools = ToolFormat("required", parallel=parallel)
        else:
            tools = ToolFormat(_parser(parser, model), parallel=parallel)
        if tools.kind in ("named", "required"):
            if structured is not None:
                raise InvalidRequest(
                    "'response_format' cannot be combined with a forced 'tool_choice'",
                    param="response_format",
                )
            schema = forced_schema([t["function"] for t in offered], forced)
            structured = Structured(kind="json_schema", schema=msgspec.json.encode(schema).decode())
    return Output(logprobs=logprobs, structured=structured, tools=tools)


def completion_output(body: CompletionRequest) -> Output:
    return Output(logprobs=body.logprobs)


def response_structured(body: ChatCompletionRequest) -> Structured | None:
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise InvalidRequest(
                "'response_format.json_schema' needs type 'json_schema'",
                param="response_format.json_schema",
            )
        return None
    if fmt.type == "json_object":
        return Structured(kind="json_object")
    if fmt.json_schema is None or fmt.json_schema.schema_ is None:
        raise InvalidRequest(
            "response_format type 'json_schema' needs 'json_schema.schema'",
            param="response_format.json_schema",
        )
    schema = msgspec.json.encode(fmt.json_schema.schema_).decode()
    return Structured(kind="json_schema", schema=schema)


def _parser(setting: ToolParser, model: ModelInfo) -> str:
    if setting is ToolParser.AUTO:
        return detect_format(model.chat_template)
    return setting.value


def _as_text(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None
) -> list[dict[str, Any]]:
    """For a template that knows neither tools nor calls: the tools in the system message,
    an assistant's calls and the tools' answers as Hermes-style text."""
    out: list[dict[str, Any]] = []
    for m in messages:
        m = dict(m)
        calls = m.pop("tool_calls", None)
        if calls:
            text = "".join(
                "<tool_call>\n"
                + msgspec.json.encode(
                    {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                ).decode()
                + "\n</tool_call>"
                for c in calls
            )
            m["content"] = (m["content"] + "\n" if m["content"] else "") + text
        if m["role"] == "tool":
            m = {"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"}
        m.pop("tool_call_id", None)
        out.append(m)
    if tools:
        prompt = tool_system_prompt(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out
