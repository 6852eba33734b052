"""What the upstream engine says to an OpenAI-compatible server and how it reads the
answers, without I/O: the request body of a token-mode call (vLLM's ``/v1/completions``
with the prompt as token ids and ``return_token_ids``), one streamed chunk turned into a
``StepOutput``, and what a failed call means (retry, continue, or give up with a code).

Token mode needs a server that takes token ids and says which ids it made: vLLM's OpenAI
server does (``prompt`` as a list of ids, ``return_token_ids``: each chunk's
``choices[0].token_ids``; ``return_tokens_as_token_ids``: logprobs keyed ``token_id:N``).
Every sampling field goes to vLLM's own request field; stop strings stay with the
project's holdback (the server is given none), as for the in-process engines.
"""

from __future__ import annotations

import email.utils
import json
import time
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from service.stream.lifecycle import EngineFinish
from service.stream.logprobs import Sampled
from service.stream.params import SamplingParams
from workers.engines.base import EngineError, StepOutput

_FINISH = {"stop": EngineFinish.STOP, "length": EngineFinish.LENGTH, "abort": EngineFinish.ABORT}
# a refusal worth asking again (the server is busy, starting, or behind a proxy that is)
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
MAX_RETRY_AFTER_S = 30.0

# error codes a request ends with (``Error.code`` in band) when the upstream fails it
UNAVAILABLE = "upstream_unavailable"  # refused, or busy (429/503) for the whole retry window
CUT = "upstream_cut"  # the answer's stream broke and could not be continued
TIMEOUT = "upstream_timeout"  # no byte for ``idle_timeout_s``, and it could not be continued
REJECTED = "upstream_rejected"  # the upstream refused the request itself (4xx)
FAILED = "upstream_error"  # the upstream said it failed (an error in its stream)


def token_body(
    model: str,
    prompt: Sequence[int],
    params: SamplingParams,
    left: int,
    generated: int,
    eos_token_ids: Sequence[int],
) -> dict[str, Any]:
    """The ``/v1/completions`` body that asks for the next ``left`` ids after ``prompt``
    (the request's prompt followed by the ``generated`` ids already made)."""
    p = params
    eos = () if p.ignore_eos else tuple(eos_token_ids)
    body: dict[str, Any] = {
        "model": model,
        "prompt": list(prompt),
        "max_tokens": left,
        "stream": True,
        "return_token_ids": True,
        "skip_special_tokens": False,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": max(p.top_k, 0) or -1,
        "min_p": p.min_p,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repetition_penalty,
        "min_tokens": min(max(p.min_tokens - generated, 0), left),
        "ignore_eos": p.ignore_eos,
        "stop_token_ids": list(dict.fromkeys((*p.stop_token_ids, *eos))),
    }
    if p.seed is not None:
        body["seed"] = p.seed
    if p.logit_bias:
        body["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    if p.logprobs is not None:
        body["logprobs"] = p.logprobs
        body["return_tokens_as_token_ids"] = True
    if p.structured is not None:
        body["structured_outputs"] = structured(p)
    return body


def structured(params: SamplingParams) -> dict[str, Any]:
    """vLLM's ``structured_outputs`` for the request's structure."""
    s = params.structured
    assert s is not None
    if s.kind == "json_object":
        return {"json_object": True}
    if s.kind == "json_schema" and s.schema is not None:
        return {"json": s.schema}
    raise EngineError(f"unknown structured output {s.kind!r}", "invalid_request")


def continuable(params: SamplingParams, generated: Sequence[int]) -> bool:
    """Whether the server can go on after ``generated`` ids as if it had made them: it
    sees them as prompt, so what counts *output* ids (the presence and frequency
    penalties, a grammar's state) would start again -- not the same answer."""
    if not generated:
        return True
    p = params
    return not (p.presence_penalty or p.frequency_penalty or p.structured is not None)


def step_of(chunk: Any, params: SamplingParams) -> StepOutput | None:
    """One streamed ``text_completion`` chunk as a step (None: a chunk without a choice,
    such as a usage-only one). Raises ``EngineError`` for an error in the stream, a
    chunk without token ids (a server that does not speak token mode), or one that is
    not shaped as vLLM's (never another exception: a chunk is the upstream's to get wrong)."""
    if not isinstance(chunk, Mapping):
        raise _malformed("chunk", chunk)
    if "error" in chunk:
        error = chunk["error"]
        message = error.get("message") if isinstance(error, Mapping) else error
        raise EngineError(f"the upstream failed the request: {message}", FAILED)
    choices = chunk.get("choices") or []
    if not choices:
        return None
    choice = choices[0] if isinstance(choices, list) else None
    if not isinstance(choice, Mapping):
        raise _malformed("choice", choices)
    ids = choice.get("token_ids")
    if ids is None:
        raise EngineError(
            "the upstream sent no token_ids: it does not speak token mode "
            "(LASTEVENT_UPSTREAM_MODE=text for a server that only streams text)",
            FAILED,
        )
    if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
        raise _malformed("token_ids", ids)
    reason = choice.get("finish_reason")
    finish = None if reason is None else _FINISH.get(str(reason), EngineFinish.ABORT)
    logprobs = None
    if params.logprobs is not None:
        logprobs = sampled(choice.get("logprobs"), params.logprobs, len(ids))
    return StepOutput(list(ids), reason is not None, finish, logprobs)


def _malformed(what: str, value: Any) -> EngineError:
    return EngineError(f"the upstream sent a {what} not shaped as vLLM's: {value!r:.200}", FAILED)


class Reader(Protocol):
    """One call's chunks as steps: ``feed`` each chunk, ``end`` at ``[DONE]`` (or when the
    stream closed): the steps it still holds (no finished one: the answer was cut)."""

    def feed(self, chunk: Mapping[str, Any]) -> list[StepOutput]: ...

    def end(self) -> list[StepOutput]: ...


class TokenReader:
    """Token mode: every chunk carries its ids (``step_of``)."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params

    def feed(self, chunk: Mapping[str, Any]) -> list[StepOutput]:
        step = step_of(chunk, self.params)
        return [] if step is None else [step]

    def end(self) -> list[StepOutput]:
        return []


class TextReader:
    """Text mode: a chat chunk's ``delta.content`` or a completion chunk's ``text``; the
    finish (its chunk) and the usage (a chunk of its own, after it) make the last step."""

    def __init__(self) -> None:
        self.finish: EngineFinish | None = None
        self.completion_tokens: int | None = None

    def feed(self, chunk: Mapping[str, Any]) -> list[StepOutput]:
        if "error" in chunk:
            step_of(chunk, SamplingParams(max_tokens=1))  # (raises the upstream's error)
        usage = chunk.get("usage")
        if isinstance(usage, Mapping) and isinstance(usage.get("completion_tokens"), int):
            self.completion_tokens = usage["completion_tokens"]
        choices = chunk.get("choices") or []
        if not choices or not isinstance(choices[0], Mapping):
            return []
        choice = choices[0]
        delta = choice.get("delta")
        text = delta.get("content") if isinstance(delta, Mapping) else choice.get("text")
        reason = choice.get("finish_reason")
        if reason is not None:
            self.finish = _FINISH.get(str(reason), EngineFinish.STOP)
        return [StepOutput([], text=text)] if isinstance(text, str) and text else []

    def end(self) -> list[StepOutput]:
        if self.finish is None:
            return []
        last = StepOutput([], True, self.finish, text="", completion_tokens=self.completion_tokens)
        return [last]


OPENAI_MAX_STOPS = 4  # OpenAI refuses more; the holdback applies all of them anyway


def text_body(
    model: str, conversation: bytes, params: SamplingParams, left: int
) -> tuple[str, dict[str, Any]]:
    """A text-mode call: its path and body (the conversation as the API kept it)."""
    p = params
    conv = json.loads(conversation or b"{}")
    body: dict[str, Any] = {
        "model": model,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": left,
        "temperature": p.temperature,
        "top_p": p.top_p,
    }
    if p.presence_penalty:
        body["presence_penalty"] = p.presence_penalty
    if p.frequency_penalty:
        body["frequency_penalty"] = p.frequency_penalty
    if p.seed is not None:
        body["seed"] = p.seed
    if p.stop:
        body["stop"] = list(p.stop[:OPENAI_MAX_STOPS])
    if p.structured is not None:
        body["response_format"] = response_format(p)
    if "messages" in conv:
        return "/chat/completions", {**body, "messages": conv["messages"]}
    if "prompt" in conv:
        return "/completions", {**body, "prompt": conv["prompt"]}
    raise EngineError(
        "the request carries no conversation for a text-mode upstream (queued by an API "
        "process that did not know the model is served in text mode)",
        "invalid_request",
    )


def response_format(params: SamplingParams) -> dict[str, Any]:
    """OpenAI's ``response_format`` for the request's structure."""
    s = params.structured
    assert s is not None
    if s.kind == "json_schema" and s.schema is not None:
        schema = {"name": "output", "schema": json.loads(s.schema)}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": "json_object"}


def sampled(logprobs: Any, k: int, count: int) -> list[Sampled]:
    """A completions chunk's logprobs (tokens spelled ``token_id:N``) as ``Sampled``: the
    sampled id's logprob, and the ``k`` best alternatives, best first."""
    if not isinstance(logprobs, Mapping):
        logprobs = {}
    values = logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or []
    if not isinstance(values, list) or not isinstance(tops, list):
        raise _malformed("logprobs", logprobs)
    if len(values) != count or len(tops) != count:
        raise EngineError(f"the upstream gave {len(values)} logprobs for {count} ids", FAILED)
    out = []
    try:
        for value, top in zip(values, tops, strict=True):
            ranked = sorted(((token_id(t), float(v)) for t, v in (top or {}).items()), key=_best)
            out.append(Sampled(float(value), tuple(ranked[:k])))
    except (AttributeError, TypeError, ValueError) as exc:  # (not numbers, not a mapping)
        raise _malformed("logprobs", logprobs) from exc
    return out


def _best(item: tuple[int, float]) -> tuple[float, int]:
    return (-item[1], item[0])


def token_id(token: str) -> int:
    """``token_id:N`` (vLLM's ``return_tokens_as_token_ids``) -> N."""
    prefix, _, number = token.rpartition(":")
    if prefix != "token_id" or not (number.isascii() and number.isdigit()):
        raise EngineError(f"the upstream's logprob token {token!r} is not token_id:N", FAILED)
    return int(number)


def retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """``Retry-After`` in seconds (delta-seconds or an HTTP date), at most
    ``MAX_RETRY_AFTER_S``; None when absent or unreadable."""
    raw = headers.get("retry-after")
    if raw is None:
        return None
    raw = raw.strip()
    try:
        seconds = float(raw)
    except ValueError:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError):
            return None
        seconds = when.timestamp() - (time.time() if now is None else now)
    if seconds != seconds:  # NaN
        return None
    return min(max(seconds, 0.0), MAX_RETRY_AFTER_S)


def refusal(status: int, body: bytes) -> EngineError:
    """A final answer other than 200 that is not worth asking again, as the request's error."""
    text = body[:500].decode("utf-8", "replace")
    if 400 <= status < 500:
        return EngineError(f"the upstream refused the request ({status}): {text}", REJECTED)
    return EngineError(f"the upstream failed the request ({status}): {text}", FAILED)
