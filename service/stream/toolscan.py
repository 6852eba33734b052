"""The JSON scanning under the tool-call parsers (``tools.py``): where a JSON value ends,
and one call object read a character at a time, emitting ``ToolFragment``s.

Nothing here decodes arguments: a call's arguments are the model's own JSON text,
passed through as it comes; only the call's name is decoded (a JSON string).
"""

from __future__ import annotations

from collections.abc import Callable

import msgspec

ARGUMENT_KEYS = ("arguments", "parameters")


class ToolFragment(msgspec.Struct, array_like=True, gc=False, frozen=True):
    """A piece of one tool call: its first piece names it, the others add arguments."""

    call: int  # the call's index within the choice (0, 1, ...)
    id: str | None = None  # on the call's first piece only
    name: str | None = None  # on the call's first piece only
    arguments: str = ""  # a piece of the arguments' JSON text, as the model wrote it


Piece = str | ToolFragment  # content text, or a piece of a call


WS = " \t\n\r"  # JSON's whitespace
FIRST = frozenset('{["-0123456789tfn')  # how a JSON value can begin
ATOM = frozenset("0123456789+-.eEtruefalsn")  # what numbers, true, false, null are made of
BARE = ATOM | frozenset(WS + ",:")  # what may stand outside strings inside a container

# what one character does to a value: belongs to it, ends it, follows it, cannot be JSON
MORE, LAST, OUT, BAD = range(4)


def push(out: list[Piece], piece: Piece) -> None:
    """Append, merged with the previous piece where both are content or the same call."""
    last = out[-1] if out else None
    if isinstance(piece, str):
        if not piece:
            return
        if isinstance(last, str):
            out[-1] = last + piece
            return
    elif piece.id is None:
        if not piece.arguments:
            return
        if isinstance(last, ToolFragment) and last.call == piece.call:
            out[-1] = ToolFragment(last.call, last.id, last.name, last.arguments + piece.arguments)
            return
    out.append(piece)


class JsonValue:
    """Where one JSON value ends, from its first character on: strings, escapes and
    nesting are tracked; outside strings, a character JSON never has there is ``BAD``
    (so a ``</tool_call>`` that follows an unclosed object is not taken into it)."""

    __slots__ = ("_atom", "_depth", "_escape", "_string")

    def __init__(self, first: str) -> None:
        self._atom = first not in '{["'
        self._depth = 1 if first in "{[" else 0
        self._string = first == '"'
        self._escape = False

    def step(self, ch: str) -> int:
        if self._string:
            if self._escape:
                self._escape = False
            elif ch == "\\":
                self._escape = True
            elif ch == '"':
                self._string = False
                if self._depth == 0:
                    return LAST
            return MORE
        if self._atom:
            return MORE if ch in ATOM else OUT
        if ch == '"':
            self._string = True
        elif ch in "{[":
            self._depth += 1
        elif ch in "}]":
            self._depth -= 1
            if self._depth == 0:
                return LAST
        elif ch not in BARE:
            return BAD
        return MORE


# the states of a call object: before "{", a key or "}", ":", a value's start, inside a
# key or value, "," or "}", and the two ends
_OPEN, _MEMBER, _COLON, _VALUE_START, _VALUE, _NEXT, _CLOSED, _BROKEN = range(8)


class CallObject:
    """One call object, ``{"name": ..., "arguments": ...}`` with its keys in any order,
    read a character at a time. Its first fragment goes out once the name's string
    closes (carrying the arguments that came before it); later ones as they come."""

    def __init__(self, index: int, call_id: Callable[[int], str]) -> None:
        self.index = index
        self.state = _OPEN
        self.name: str | None = None
        self.started = False  # its first fragment went out
        self._call_id = call_id
        self._value: JsonValue | None = None
        self._role = ""  # what is being read: "key", "name", "args", or "" (skipped)
        self._next_role = ""  # the role of the value after the key just read
        self._text: list[str] = []  # the key or name being read
        self._args: list[str] = []  # arguments text not yet emitted
        self._has_args = False

    @property
    def ended(self) -> bool:
        return self.state >= _CLOSED

    @property
    def broken(self) -> bool:
        return self.state == _BROKEN

    def feed(self, text: str, out: list[Piece]) -> int:
        """Read ``text`` until the object ends; how much of it the object took."""
        i, n = 0, len(text)
        while i < n and self.state < _CLOSED:
            if self._char(text[i]):
                i += 1
        self._flush(out)
        return i

    def _char(self, ch: str) -> bool:
        """One character; False: not taken (it is read again in the new state)."""
        state = self.state
        if state == _VALUE:
            return self._in_value(ch)
        if ch in WS:
            return True
        if state == _OPEN and ch == "{":
            self.state = _MEMBER
        elif state == _MEMBER and ch == '"':
            self._begin("key", ch)
        elif state in (_MEMBER, _NEXT) and ch == "}":
            self.state = _CLOSED
            if self.name is not None and not self._has_args:
                self._args.append("{}")
        elif state == _COLON and ch == ":":
            self.state = _VALUE_START
        elif state == _NEXT and ch == ",":
            self.state = _MEMBER
        elif state == _VALUE_START and ch in FIRST and (ch == '"' or self._next_role != "name"):
            self._has_args |= self._next_role == "args"
            self._begin(self._next_role, ch)
        else:
            self.state = _BROKEN
            return False
        return True

    def _begin(self, role: str, ch: str) -> None:
        self._role, self._value, self.state = role, JsonValue(ch), _VALUE
        self._take(ch)

    def _take(self, ch: str) -> None:
        if self._role == "args":
            self._args.append(ch)
        elif self._role:
            self._text.append(ch)

    def _in_value(self, ch: str) -> bool:
        assert self._value is not None
        step = self._value.step(ch)
        if step == BAD:
            self.state = _BROKEN
            return False
        if step == OUT:
            self._end_value()
            return False
        self._take(ch)
        if step == LAST:
            self._end_value()
        return True

    def _end_value(self) -> None:
        role, raw = self._role, "".join(self._text)
        self._text, self._value, self.state = [], None, _NEXT
        if role not in ("key", "name"):
            return
        try:
            decoded = msgspec.json.decode(raw, type=str)
        except msgspec.DecodeError:  # a bad escape, a raw control character
            self.state = _BROKEN
            return
        if role == "name":
            self.name = decoded
            return
        self.state = _COLON
        if decoded == "name" and self.name is None:
            self._next_role = "name"
        elif decoded in ARGUMENT_KEYS and not self._has_args:
            self._next_role = "args"
        else:
            self._next_role = ""

    def _flush(self, out: list[Piece]) -> None:
        if self.name is None:
            return  # the arguments wait for the name
        args, self._args = "".join(self._args), []
        if not self.started:
            self.started = True
            out.append(ToolFragment(self.index, self._call_id(self.index), self.name, args))
        else:
            push(out, ToolFragment(self.index, arguments=args))
