"""The sampling parameters: one struct from the request schema to the engine.

``SamplingParams`` is what the API puts in the job and what every engine's
``generate`` receives. The public request schemas take their sampling fields
from it (``RequestSampling``: each field optional, ``null`` meaning the default),
and ``SamplingParams.from_request`` copies whatever the client gave. A new
sampling parameter is therefore one field here, with its bounds, plus what each
engine does with it (an engine that cannot honour it must say so).

``max_tokens``, ``stop``, ``logprobs`` and ``structured`` are resolved by the API (the
server default, the context length, stop-string limits; chat's ``logprobs`` +
``top_logprobs`` and completions' ``logprobs``; ``response_format`` and a forced
``tool_choice``) and are declared in the schemas themselves.

Every engine honours every field here or says which it cannot (``UNSUPPORTED``: the
API answers 400 naming the field and the engine before the request exists).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Optional

import msgspec
from msgspec import Meta

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs limit)
_Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]


class Structured(msgspec.Struct, kw_only=True, frozen=True, array_like=True):
    """Constrained decoding: the output must be JSON (``json_object``), or JSON valid
    against ``schema`` (a JSON Schema as JSON text)."""

    kind: str  # "json_object" | "json_schema"
    schema: str | None = None


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    # applied by the project's holdback, not by the engine
    stop: tuple[str, ...] = ()
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0  # 0: greedy
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Meta(ge=_INT64_MIN, le=_INT64_MAX)] | None = None
    # OpenAI's penalties (additive, on the counts of ids already generated) and vLLM's
    presence_penalty: _Penalty = 0.0
    frequency_penalty: _Penalty = 0.0
    repetition_penalty: Annotated[float, Meta(gt=0.0, le=2.0)] = 1.0  # 1: none (HF/vLLM's)
    top_k: Annotated[int, Meta(ge=-1)] = -1  # -1 or 0: all
    min_p: Annotated[float, Meta(ge=0.0, le=1.0)] = 0.0
    min_tokens: Annotated[int, Meta(ge=0)] = 0  # EOS / stop ids are masked before this many
    ignore_eos: bool = False  # go on past EOS until max_tokens (benchmarks)
    # added to the logits of these ids (OpenAI: keys are token ids, values -100..100)
    logit_bias: dict[int, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    stop_token_ids: tuple[Annotated[int, Meta(ge=0)], ...] = ()  # besides the model's EOS
    # resolved by the API: the logprob of each sampled id and of the ``logprobs`` most
    # likely ids (None: none asked; 0: the sampled id's only)
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    structured: Structured | None = None

    @classmethod
    def from_request(cls, body: Any, **resolved: Any) -> SamplingParams:
        """The fields ``body`` (a request struct) sets, plus what the API resolved."""
        given = {
            name: value
            for name in REQUEST_FIELDS
            if (value := getattr(body, name, None)) is not None
        }
        return cls(**given, **resolved)


RESOLVED_BY_API = frozenset({"max_tokens", "stop", "logprobs", "structured"})
REQUEST_FIELDS = tuple(
    f.name for f in msgspec.structs.fields(SamplingParams) if f.name not in RESOLVED_BY_API
)

# what each engine cannot honour (the API answers 400 naming the field and the engine)
UNSUPPORTED: dict[str, frozenset[str]] = {
    "scripted": frozenset(),
    "cpu": frozenset(),
    "vllm": frozenset(),
    "upstream": frozenset(),  # token mode: vLLM's server takes every field
    # text mode: an OpenAI-compatible server's fields only, and no ids of our tokenizer
    "upstream-text": frozenset(
        {
            "repetition_penalty",
            "top_k",
            "min_p",
            "min_tokens",
            "ignore_eos",
            "logit_bias",
            "stop_token_ids",
            "logprobs",
        }
    ),
}


def unsupported(engine: str, params: SamplingParams) -> list[str]:
    """The fields ``params`` sets away from their defaults that ``engine`` cannot honour."""
    refused = UNSUPPORTED.get(engine, frozenset())
    defaults = SamplingParams(max_tokens=1)
    return [name for name in sorted(refused) if getattr(params, name) != getattr(defaults, name)]


if TYPE_CHECKING:

    class RequestSampling(msgspec.Struct, kw_only=True):
        """The sampling fields of a request (see ``SamplingParams``)."""

else:
    RequestSampling = msgspec.defstruct(
        "RequestSampling",
        [
            (f.name, Optional[f.type], None)  # noqa: UP045 - a runtime type, not an annotation
            for f in msgspec.structs.fields(SamplingParams)
            if f.name in REQUEST_FIELDS
        ],
        kw_only=True,
        module=__name__,
    )
