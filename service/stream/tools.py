"""Tool calls in model output: one incremental parser per model family's format.

The worker feeds a parser the text the stop-string holdback releases, step by step,
and logs what it returns: content text, or ``ToolFragment``s -- the pieces of OpenAI's
``tool_calls`` deltas. Every parser is monotone: for any split of the same output into
``feed`` calls, the joined content and each call's joined (id, name, arguments) are the
same; a split only changes how the pieces are cut.

A call's arguments are the model's own JSON text, streamed as it comes (never decoded
and encoded again, so nothing is reordered or reformatted); only the whitespace before
the value is dropped. One small scanner (``_Value``: strings, escapes, nesting) finds
where a value ends; nothing else of the JSON is checked, constrained decoding or the
client does that. Arguments written before ``"name"`` wait until the name is known.

Choices where the formats leave room:

- hermes: a proper prefix of ``<tool_call>`` at the end of the text (``"<tool"``) is
  held until the next text decides; a lookalike (``<tool_calls>``, ``<tool box``) is
  content. Whitespace just before ``<tool_call>`` and just after ``</tool_call>`` is not
  content. A block that is not a call (not a JSON object with a string ``"name"``) is
  content, raw and markers included, once ``</tool_call>`` (or the end) shows it;
  a block that broke after its call started ends that call, the rest of the block is
  dropped.
- llama3_json: calls only if the output starts (after whitespace) with ``{`` or
  ``<|python_tag|>``; when its first object proves no call, the whole output is content;
  text after the calls (other than ``;`` and the next object) is dropped (``done``).
- named: the call's first piece comes with the first non-whitespace character (or at
  ``finish``, empty, when none came). required: an element without a name is skipped;
  anything constrained decoding cannot give ends the parse.
- Every format: a closed call object without arguments gets ``"{}"``; a call cut by
  the end of the output (max_tokens) ends with the arguments text that came.
  ``parallel`` False: the parser is ``done`` once the first call's object closes (before
  ``</tool_call>``); what follows is dropped, not shown.
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

from service.stream.toolscan import ARGUMENT_KEYS, Piece, ToolFragment
from service.stream.toolscan import LAST as _LAST
from service.stream.toolscan import MORE as _MORE
from service.stream.toolscan import WS as _WS
from service.stream.toolscan import CallObject as _Call
from service.stream.toolscan import JsonValue as _Value
from service.stream.toolscan import push as _push

__all__ = ["ARGUMENT_KEYS", "Piece", "ToolFragment"]  # (the log's types live in toolscan)


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


CALL_START, CALL_END = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


def _partial(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


Handler = Callable[[str, list[Piece]], str]  # takes text, returns what it left for the next state


class _Machine(ToolParser):
    """What the parsers share: a handler per state, the call being read, the count."""

    def __init__(self, fmt: ToolFormat, call_id: Callable[[int], str], state: str) -> None:
        self._parallel = fmt.parallel
        self._call_id = call_id
        self._calls = 0
        self._call = _Call(0, call_id)
        self._state = state
        self._handlers: dict[str, Handler] = {}

    def feed(self, text: str) -> list[Piece]:
        out: list[Piece] = []
        while text and self._state != "done":
            text = self._handlers[self._state](text, out)
        return out

    @property
    def calls(self) -> int:
        return self._calls

    @property
    def done(self) -> bool:
        return self._state == "done"

    def _new_call(self, state: str) -> None:
        self._call, self._state = _Call(self._calls, self._call_id), state

    def _scan(self, text: str, out: list[Piece]) -> int:
        started = self._call.started
        taken = self._call.feed(text, out)
        if self._call.started and not started:
            self._calls += 1
        return taken

    def _after_call(self, rest: str) -> str:
        """The state after a started call ended: done when only one call counts."""
        if not self._parallel:
            self._state = "done"
            return ""
        return rest


class _Hermes(_Machine):
    """``<tool_call>`` blocks among content."""

    def __init__(self, fmt: ToolFormat, call_id: Callable[[int], str]) -> None:
        super().__init__(fmt, call_id, "content")
        self._handlers = {
            "content": self._content,
            "block": self._block,
            "skip": self._until_end,  # the rest of a call's block
            "bad": self._until_end,  # a block that is not a call
        }
        self._held = ""  # content that may still be a marker's start; a marker's start
        self._raw = ""  # the block while it may prove to be content
        self._strip = False  # just after a call: whitespace is not content

    def _content(self, text: str, out: list[Piece]) -> str:
        buf, self._held = self._held + text, ""
        if self._strip:
            buf = buf.lstrip()
            if not buf:
                return ""
            self._strip = False
        at = buf.find(CALL_START)
        if at >= 0:
            before = buf[:at]
            content = before.rstrip()
            _push(out, content)
            self._raw = before[len(content) :] + CALL_START
            self._new_call("block")
            return buf[at + len(CALL_START) :]
        cut = len(buf[: len(buf) - _partial(buf, CALL_START)].rstrip())
        _push(out, buf[:cut])
        self._held = buf[cut:]
        return ""

    def _block(self, text: str, out: list[Piece]) -> str:
        taken = self._scan(text, out)
        call = self._call
        self._raw = "" if call.started else self._raw + text[:taken]
        if not call.ended:
            return ""
        self._state = "skip" if call.started else "bad"
        return self._after_call(text[taken:]) if call.started else text[taken:]

    def _until_end(self, text: str, out: list[Piece]) -> str:
        buf, self._held = self._held + text, ""
        at = buf.find(CALL_END)
        bad = self._state == "bad"
        if at < 0:
            cut = len(buf) - _partial(buf, CALL_END)
            if bad:
                self._raw += buf[:cut]
            self._held = buf[cut:]
            return ""
        end = at + len(CALL_END)
        if bad:
            _push(out, self._raw + buf[:end])
        self._raw, self._strip, self._state = "", not bad, "content"
        return buf[end:]

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._state == "content":
            _push(out, self._held)
        elif self._state == "bad" or (self._state == "block" and not self._call.started):
            _push(out, self._raw + self._held)
        self._held = self._raw = ""
        self._state = "done"
        return out


class _Llama(_Machine):
    """Llama 3.x JSON calls: the whole output, or content if it does not start as one."""

    def __init__(self, fmt: ToolFormat, call_id: Callable[[int], str]) -> None:
        super().__init__(fmt, call_id, "start")
        self._handlers = {
            "start": self._start,
            "content": self._content,
            "call": self._object,
            "between": self._between,
        }
        self._raw = ""  # the output while its first object may prove to be content

    def _start(self, text: str, out: list[Piece]) -> str:
        self._raw += text
        body = self._raw.lstrip()
        if not body or (PYTHON_TAG.startswith(body) and body != PYTHON_TAG):
            return ""
        lead = len(self._raw) - len(body)
        if body.startswith(PYTHON_TAG):
            lead += len(PYTHON_TAG)
        elif body[0] != "{":
            self._state = "content"
            return self._take_raw()
        rest, self._raw = self._raw[lead:], self._raw[:lead]
        self._new_call("call")
        return rest

    def _take_raw(self) -> str:
        raw, self._raw = self._raw, ""
        return raw

    def _content(self, text: str, out: list[Piece]) -> str:
        _push(out, text)
        return ""

    def _object(self, text: str, out: list[Piece]) -> str:
        taken = self._scan(text, out)
        call = self._call
        if self._calls == 0:
            self._raw += text[:taken]
        if not call.ended:
            return ""
        rest = text[taken:]
        if call.started:
            self._raw = ""
            self._state = "done" if call.broken else "between"
            return self._after_call(rest)
        if self._calls == 0:  # the first object is no call: the output is content
            self._state = "content"
            return self._take_raw() + rest
        self._state = "done"
        return ""

    def _between(self, text: str, out: list[Piece]) -> str:
        body = text.lstrip(_WS)
        if not body:
            return ""
        if body[0] not in ";{":
            self._state = "done"
            return ""
        self._new_call("call")
        return body[1:] if body[0] == ";" else body

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._state == "start" or (self._state == "call" and self._calls == 0):
            _push(out, self._raw)
        self._raw, self._state = "", "done"
        return out


class _Named(_Machine):
    """The output is the arguments of the one function that ``tool_choice`` names."""

    def __init__(self, fmt: ToolFormat, call_id: Callable[[int], str]) -> None:
        super().__init__(fmt, call_id, "start")
        self._name = fmt.name or ""
        self._handlers = {"start": self._start, "value": self._value_text}
        self._value: _Value | None = None

    def _start(self, text: str, out: list[Piece]) -> str:
        body = text.lstrip(_WS)
        if not body:
            return ""
        self._value = _Value(body[0])
        self._name_it(body[0], out)
        self._state = "value"
        return body[1:]

    def _name_it(self, arguments: str, out: list[Piece]) -> None:
        self._calls = 1
        out.append(ToolFragment(0, self._call_id(0), self._name, arguments))

    def _value_text(self, text: str, out: list[Piece]) -> str:
        assert self._value is not None
        for i, ch in enumerate(text):
            step = self._value.step(ch)
            if step != _MORE:
                end = i + 1 if step == _LAST else i
                _push(out, ToolFragment(0, arguments=text[:end]))
                self._state = "done"
                return ""
        _push(out, ToolFragment(0, arguments=text))
        return ""

    def finish(self) -> list[Piece]:
        out: list[Piece] = []
        if self._calls == 0:
            self._name_it("", out)
        self._state = "done"
        return out


class _Required(_Machine):
    """The output is a JSON array of call objects (``tool_choice: "required"``)."""

    def __init__(self, fmt: ToolFormat, call_id: Callable[[int], str]) -> None:
        super().__init__(fmt, call_id, "open")
        self._handlers = {
            "open": self._punct,  # before "["
            "element": self._punct,  # after "[" or ","
            "call": self._element,
            "after": self._punct,  # after an element
        }

    def _punct(self, text: str, out: list[Piece]) -> str:
        body = text.lstrip(_WS)
        if not body:
            return ""
        ch, state = body[0], self._state
        if state == "element" and ch == "{":
            self._new_call("call")
            return body
        if (state, ch) in (("open", "["), ("after", ",")):
            self._state = "element"
            return body[1:]
        self._state = "done"  # "]", or what constrained decoding cannot give
        return ""

    def _element(self, text: str, out: list[Piece]) -> str:
        taken = self._scan(text, out)
        call = self._call
        if not call.ended:
            return ""
        self._state = "done" if call.broken else "after"
        return self._after_call(text[taken:]) if call.started else text[taken:]

    def finish(self) -> list[Piece]:
        self._state = "done"
        return []


_PARSERS: dict[str, Callable[[ToolFormat, Callable[[int], str]], ToolParser]] = {
    "hermes": _Hermes,
    "llama3_json": _Llama,
    "named": _Named,
    "required": _Required,
}


def parser_for(fmt: ToolFormat, call_id: Callable[[int], str]) -> ToolParser:
    """The parser for ``fmt``; ``call_id(call_index)`` makes each call's id."""
    try:
        make = _PARSERS[fmt.kind]
    except KeyError:
        raise ValueError(f"unknown tool format {fmt.kind!r}") from None
    return make(fmt, call_id)
