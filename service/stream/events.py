"""The event log's payloads, and the outbox summary written with the terminal event.

Every entry of a request's Redis stream holds one of these structs, encoded with
msgpack (``array_like``: the field names are not stored). They are the *internal*
format; readers render OpenAI chunks from them (``render.py``), so one log serves
chat, text completions and any later API shape. The states an ``End`` names are
in ``lifecycle.py``.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable

import msgspec

from service.stream.lifecycle import FinishReason, State
from service.stream.logprobs import Logprob
from service.stream.tools import ToolFragment


class Kind(enum.StrEnum):
    CHAT = "chat"  # /v1/chat/completions
    TEXT = "text"  # /v1/completions
    RESPONSE = "response"  # /v1/responses


class _Event(msgspec.Struct, array_like=True, gc=False, tag_field="t"):
    pass


class Created(_Event, tag="c"):
    """First entry of every log, written by the API when it accepts the request."""

    kind: str
    model: str
    created: int  # unix seconds, the OpenAI ``created`` field
    prompt_tokens: int
    include_usage: bool = False
    tenant: str = "default"
    api_key_id: str | None = None
    # (new fields go last: entries are arrays, and logs written before them still decode)
    n: int = 1  # choices
    user: str | None = None  # the request's ``user`` (recorded in the ledger)
    continuous_usage: bool = False  # every chunk carries the usage so far (vLLM's)
    # /v1/responses: the request's parameters as every response object echoes them (JSON)
    response: bytes | None = None
    # False (``store: false``): not archived, and the hot log lapses soon after the end
    store: bool = True
    # what was asked (the request body as JSON: messages, tools, parameters), kept when the
    # client sent ``store: true`` or an operator keeps every input; the request's
    # ``metadata``; ``listed``: ``store: true`` on a chat completion (OpenAI's stored
    # completions: its tenant's ``GET /v1/chat/completions`` lists it)
    input: bytes | None = None
    metadata: dict[str, str] | None = None
    listed: bool = False


class Delta(_Event, tag="d"):
    """Text released in one engine step, and the token ids consumed since the previous delta.

    ``n`` is the count of completion tokens consumed so far (including ``token_ids``).
    The ids let a worker that takes over rebuild the request's state from the log.
    """

    text: str
    token_ids: list[int]
    n: int
    index: int = 0  # the choice (n > 1)
    # the sampled ids' logprobs (when asked: one per id of ``token_ids`` but EOS), and
    # for text completions the characters of the choice's text before this delta
    logprobs: list[Logprob] | None = None
    offset: int | None = None
    tools: list[ToolFragment] | None = None  # pieces of tool calls, after ``text``
    # on the first delta a worker appends after it claimed the request: the worker, and
    # how it came to run it (``CLAIMS``) -- where the console shows a worker died and
    # another continued
    by: str | None = None
    how: str | None = None
    # the tokens it stands for, when it carries no ids (an engine that streams text)
    tokens: int | None = None

    @property
    def consumed(self) -> int:
        """The completion tokens since the previous delta of its choice."""
        return len(self.token_ids) if self.tokens is None else self.tokens


# how a worker came to run a request: its first run, after its worker was lost, handed
# over by a stopping worker, after it was parked (no reader) and a reader came back, or
# served again by the same worker (Redis failed under it)
CLAIMS = ("first", "takeover", "handover", "resumed", "continued")


class Error(_Event, tag="x"):
    """An in-band error. The terminal ``End`` (state ``errored``) follows it."""

    code: str
    message: str


class End(_Event, tag="e"):
    """The terminal event: exactly one per log, always last. Built by ``endings.py`` only."""

    state: State
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    wasted_tokens: int = 0  # generated but never delivered to any reader (aborts)
    # the cost of recovery, apart from the usage: times another worker continued the
    # request after its worker was lost / after a stopping worker handed it over, and
    # the prompt + logged tokens those workers prefilled again to continue it
    takeovers: int = 0
    handovers: int = 0
    reprefill_tokens: int = 0
    finish_reasons: list[FinishReason | None] | None = None  # per choice, when n > 1


Event = Created | Delta | Error | End


def completion_tokens(events: Iterable[Event]) -> int:
    """The completion tokens ``events`` (a log, or a part of one) reach: each choice's
    last count, summed."""
    last: dict[int, int] = {}
    for e in events:
        if isinstance(e, Delta):
            last[e.index] = max(last.get(e.index, 0), e.n)
    return sum(last.values())


class Progress:
    """How far each choice of a log has come, as a reader sends it. A delta starts where
    the previous delta of its choice ended (its ``n`` less the ids it carries); one that
    does not is a gap or a repeat -- a log that lost entries (Redis failed over before
    they reached a replica), or a continuation spliced after a shortened log -- which a
    reader must not send (nor count: a delta that does not follow on moves nothing). A
    reader that starts mid-log checks from its first delta on."""

    __slots__ = ("_n",)

    def __init__(self) -> None:
        self._n: dict[int, int] = {}

    def follows(self, event: Event) -> bool:
        if isinstance(event, Created):
            self._n = dict.fromkeys(range(max(event.n, 1)), 0)
        elif isinstance(event, Delta):
            before = self._n.get(event.index)
            if before is not None and event.n - event.consumed != before:
                return False
            self._n[event.index] = event.n
        return True

    @property
    def tokens(self) -> int:
        """The completion tokens the deltas that followed on reached, all choices."""
        return sum(self._n.values())


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Event)


def encode(event: Event) -> bytes:
    return _encoder.encode(event)


def decode(data: bytes) -> Event:
    return _decoder.decode(data)


class Summary(msgspec.Struct, array_like=True, gc=False, omit_defaults=True):
    """What the billing row needs, written to the outbox with the terminal event (built by
    ``endings.py`` with the ``End`` it agrees with)."""

    request_id: str
    kind: str
    model: str
    created_ms: int
    state: State
    finish_reason: FinishReason | None
    prompt_tokens: int
    completion_tokens: int
    wasted_tokens: int = 0
    dispatched_ms: int | None = None
    first_token_ms: int | None = None
    error_code: str | None = None
    worker_id: str | None = None
    tenant: str | None = None
    api_key_id: str | None = None
    # (new fields go last: entries are arrays, and the outbox may hold older ones)
    takeovers: int = 0
    handovers: int = 0
    reprefill_tokens: int = 0
    user: str | None = None
    store: bool = True  # False: the recorder writes the billing row, not the archive
    metadata: dict[str, str] | None = None  # the request's ``metadata``
    listed: bool = False  # ``store: true``: a stored chat completion


_summary_decoder = msgspec.msgpack.Decoder(Summary)


def encode_summary(summary: Summary) -> bytes:
    return _encoder.encode(summary)


def decode_summary(data: bytes) -> Summary:
    return _summary_decoder.decode(data)
