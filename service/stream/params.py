"""The sampling parameters: one struct from the request schema to the engine.

``SamplingParams`` is what the API puts in the job and what every engine's
``generate`` receives. The public request schemas take their sampling fields
from it (``RequestSampling``: each field optional, ``null`` meaning the default),
and ``SamplingParams.from_request`` copies whatever the client gave. A new
sampling parameter is therefore one field here, with its bounds, plus what each
engine does with it (an engine that cannot honour it must say so).

``max_tokens`` and ``stop`` are resolved by the API (the server default, the
context length, stop-string limits) and are declared in the schemas themselves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any, Optional

import msgspec
from msgspec import Meta

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    # applied by the project's holdback, not by the engine
    stop: tuple[str, ...] = ()
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] = 1.0  # 0: greedy
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Meta(ge=_INT64_MIN, le=_INT64_MAX)] | None = None

    @classmethod
    def from_request(cls, body: Any, **resolved: Any) -> SamplingParams:
        """The fields ``body`` (a request struct) sets, plus what the API resolved."""
        given = {
            name: value
            for name in REQUEST_FIELDS
            if (value := getattr(body, name, None)) is not None
        }
        return cls(**given, **resolved)


RESOLVED_BY_API = frozenset({"max_tokens", "stop"})
REQUEST_FIELDS = tuple(
    f.name for f in msgspec.structs.fields(SamplingParams) if f.name not in RESOLVED_BY_API
)

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
