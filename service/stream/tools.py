"""Tool calls in model output: one incremental parser per model family's format.

INTERFACE (the parsers are being written; the types and signatures here are fixed):

The worker feeds a parser the text the stop-string holdback releases, step by step,
and logs what it returns: content text, or ``ToolFragment``s -- the pieces of OpenAI's
``tool_calls`` deltas. A parser holds back text that may still become a call's start
marker, so a marker never leaks into content, and is monotone: for any split of the
same output into ``feed`` calls, the joined content and each call's joined
(id, name, arguments) are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import msgspec


class ToolFragment(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A piece of one tool call: its first piece names it, the others add arguments."""

    call: int  # the call's index within the choice (0, 1, ...)
    id: str | None = None  # on the call's first piece only
    name: str | None = None  # on the call's first piece only
    arguments: str = ""  # a piece of the arguments' JSON text, as the model wrote it


Piece = str | ToolFragment  # content text, or a piece of a call


class ToolFormat(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """How the output of one request holds its calls (travels in the job).

    ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5,
    Hermes), any number, content around them. ``llama3_json``: the output is
    ``{"name": ..., "parameters": {...}}`` (``; ``-separated for several), optionally
    after ``<|python_tag|>`` (Llama 3.x). ``named``: the output *is* the arguments of
    the function ``name`` (a named ``tool_choice``: decoding is constrained to its
    parameters schema). ``required``: the output is a JSON array of
    ``{"name": ..., "parameters": {...}}`` (``tool_choice: "required"``, constrained).
    ``parallel`` False: only the first call counts; the parser is ``done`` once it ends.
    """

    kind: str
    name: str | None = None
    parallel: bool = True


class ToolParser:
    """Base: ``feed`` text, ``finish`` at the end of the output."""

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        """The output is over: what is still held, as content or as the end of a call."""
        raise NotImplementedError

    @property
    def calls(self) -> int:
        """How many calls have started."""
        raise NotImplementedError

    @property
    def done(self) -> bool:
        """Nothing more can be emitted (a named call's object closed; the first call of a
        non-parallel request closed): the engine may stop."""
        raise NotImplementedError


def parser_for(fmt: ToolFormat, call_id: Callable[[int], str]) -> ToolParser:
    """The parser for ``fmt``; ``call_id(call_index)`` makes each call's id."""
    raise NotImplementedError


def detect_format(chat_template: str) -> str:
    """The model family's format, from its chat template ("hermes" when unsure)."""
    raise NotImplementedError


def tool_system_prompt(tools: Sequence[dict[str, Any]]) -> str:
    """A Hermes-style system text listing ``tools``, for a chat template that does not
    render ``tools`` itself."""
    raise NotImplementedError


def forced_schema(tools: Sequence[dict[str, Any]], choice: str | None) -> dict[str, Any]:
    """The JSON Schema constrained decoding uses for a forced ``tool_choice``: the
    function's parameters (``choice`` names it), or (``choice`` None: "required") an
    array of at least one ``{"name": <one of them>, "parameters": <its schema>}``."""
    raise NotImplementedError
