"""Log events -> OpenAI Responses API streaming events (``/v1/responses``).

``ResponsesRenderer`` is a state machine fed a request's log *from its first event*: the
Responses API numbers its events (``sequence_number``) over the whole stream, and one
text delta opens an item here and only continues it there, so a frame depends on what
came before it. Starting from the log's first event every time makes the numbering a
pure function of the log: resuming after sequence number N is "render everything, drop
the frames up to N" (``frames_after``), and live, resumed and replayed streams are the
same bytes. Item ids are derived from the response id and the item's place.

    Created                   response.created, response.in_progress (background:
                              response.created and response.queued, both "queued";
                              response.in_progress comes with the first delta)
    Delta text                [response.output_item.added + content_part.added]
                              response.output_text.delta
    Delta tools (first piece) close the open item; response.output_item.added
    Delta tools (arguments)   response.function_call_arguments.delta
    Error                     nothing yet: its code and message go to response.failed
    End                       close the open item; then, by state and finish_reason:
                              response.completed | .incomplete | .failed | .cancelled

Closing a message: output_text.done, content_part.done, output_item.done; a call:
function_call_arguments.done, output_item.done. An item the End cuts short (length,
cancel, error) closes ``incomplete``, as OpenAI marks the item a ``max_output_tokens``
stop truncated. OpenAI's stream has no event for a cancelled response (its webhook
event for one is ``response.cancelled``): a cancelled or abandoned request ends with a
``response.cancelled`` event carrying the response, status ``cancelled``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import msgspec

from service.stream.events import Created, Delta, End, Error, Event
from service.stream.lifecycle import FinishReason, State
from service.stream.logprobs import Logprob
from service.stream.response_items import Item, item_id, logprob
from service.stream.toolscan import ToolFragment

_json = msgspec.json.Encoder()

# the fields of the response object this module owns; params may not set them
RESERVED = frozenset(
    {
        "id",
        "object",
        "created_at",
        "completed_at",
        "status",
        "error",
        "incomplete_details",
        "output",
        "usage",
    }
)
# the request's parameters as OpenAI echoes them when the request left them out
DEFAULTS: dict[str, Any] = {
    "background": False,
    "frequency_penalty": 0.0,
    "instructions": None,
    "max_output_tokens": None,
    "max_tool_calls": None,
    "parallel_tool_calls": True,
    "presence_penalty": 0.0,
    "previous_response_id": None,
    "prompt_cache_key": None,
    "reasoning": {"effort": None, "summary": None},
    "safety_identifier": None,
    "service_tier": "auto",
    "store": True,
    "temperature": 1.0,
    "text": {"format": {"type": "text"}},
    "tool_choice": "auto",
    "tools": [],
    "top_logprobs": 0,
    "top_p": 1.0,
    "truncation": "disabled",
    "user": None,
    "metadata": {},
}
# a function tool as the spec's ``FunctionTool`` shows it: every field, null when unset
TOOL_FIELDS = ("type", "name", "description", "parameters", "strict")
FAILED = Error(code="server_error", message="the request failed")  # an errored End alone


@dataclasses.dataclass(frozen=True, slots=True)
class Frame:
    """One streaming event: ``data`` is its JSON object (with ``type`` and
    ``sequence_number``); ``type`` is there again for the SSE ``event:`` line."""

    type: str
    data: dict[str, Any]

    @property
    def sequence_number(self) -> int:
        number: int = self.data["sequence_number"]
        return number

    def json(self) -> bytes:
        return _json.encode(self.data)


def ending(end: End) -> tuple[str, str]:
    """The final event's type and the response's status for a terminal event."""
    if end.state == State.FINISHED:
        if end.finish_reason == FinishReason.LENGTH:
            return "response.incomplete", "incomplete"
        if end.finish_reason in (FinishReason.STOP, FinishReason.TOOL_CALLS):
            return "response.completed", "completed"
        raise ValueError(f"a finished request with finish_reason {end.finish_reason!r}")
    if end.state == State.ERRORED:
        return "response.failed", "failed"
    if end.state in (State.CANCELLED, State.ABANDONED):
        return "response.cancelled", "cancelled"
    raise ValueError(f"an End with the non-terminal state {end.state!r}")


def echoed_tool(tool: dict[str, Any]) -> dict[str, Any]:
    """A request's tool as the response echoes it: the fields it left out as null."""
    if tool.get("type") != "function":
        return tool
    return {**{k: tool.get(k) for k in TOOL_FIELDS}, **tool}


class ResponsesRenderer:
    """Renders one request's log, fed in order from its ``Created``, as ``Frame``s.

    ``params``: the request's parameters as the response object echoes them (OpenAI's
    names: model, instructions, tools, text, metadata, ...); those left out take
    OpenAI's defaults, the model is the log's unless ``params`` names one.
    """

    def __init__(self, response_id: str, created: Created, params: dict[str, Any]) -> None:
        reserved = sorted(RESERVED & params.keys())
        if reserved:
            raise ValueError(f"params may not set the response's own fields: {reserved}")
        if created.n != 1:
            raise ValueError(f"the Responses API has one output (n=1), not n={created.n}")
        self.response_id = response_id
        self.created = created
        self._params = {"model": created.model, **DEFAULTS, "user": created.user}
        self._params.update(params)
        self._params["tools"] = [echoed_tool(t) for t in self._params["tools"]]
        self.background = bool(self._params["background"])
        self._seq = 0
        self._started = False  # the Created was fed
        self._running = not self.background  # response.in_progress was sent
        self._items: list[Item] = []
        self._open: Item | None = None
        self._logprobs: list[Logprob] = []  # a delta's, waiting for text to carry them
        self._error: Error | None = None
        self._end: End | None = None

    @property
    def sequence_number(self) -> int:
        """The next frame's sequence number (the count of frames so far)."""
        return self._seq

    @property
    def status(self) -> str:
        if self._end is not None:
            return ending(self._end)[1]
        return "in_progress" if self._running else "queued"

    def feed(self, event: Event) -> list[Frame]:
        if self._end is not None:
            raise ValueError(f"the log goes on after its End: {event!r}")
        if isinstance(event, Created):
            if self._started:
                raise ValueError("a second Created")
            self._started = True
            second = "response.queued" if self.background else "response.in_progress"
            return [self._with_response("response.created"), self._with_response(second)]
        if not self._started:
            raise ValueError(f"the log starts with Created, not {event!r}")
        if self._error is not None and not isinstance(event, End):
            raise ValueError(f"only the End follows an Error, not {event!r}")
        if isinstance(event, Delta):
            return self._delta(event)
        if isinstance(event, Error):
            self._error = event
            return []
        if isinstance(event, End):
            return self._finish(event)
        raise TypeError(f"unknown event {event!r}")

    def response_object(self) -> dict[str, Any]:
        """The response as it stands (``GET /v1/responses/{id}``, and inside the
        created / in_progress / final events)."""
        params = self._params
        known = {k: params[k] for k in ("model", *DEFAULTS)}
        extra = {k: params[k] for k in sorted(params.keys() - known.keys())}
        end = self._end
        error = None
        if end is not None and end.state == State.ERRORED:
            err = self._error or FAILED
            error = {"code": err.code, "message": err.message}
        incomplete = None
        if self.status == "incomplete":
            incomplete = {"reason": "max_output_tokens"}
        usage = None
        if end is not None:
            usage = {
                "input_tokens": end.prompt_tokens,
                "input_tokens_details": {"cached_tokens": 0},
                "output_tokens": end.completion_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": end.prompt_tokens + end.completion_tokens,
            }
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created.created,
            # the log keeps no time of its End: null (the spec's "if it was completed")
            "completed_at": None,
            "status": self.status,
            "error": error,
            "incomplete_details": incomplete,
            "output": [item.render() for item in self._items],
            "usage": usage,
            **known,
            **extra,
        }

    def _frame(self, type_: str, **fields: Any) -> Frame:
        frame = Frame(type_, {"type": type_, "sequence_number": self._seq, **fields})
        self._seq += 1
        return frame

    def _with_response(self, type_: str) -> Frame:
        return self._frame(type_, response=self.response_object())

    def _delta(self, d: Delta) -> list[Frame]:
        if d.index != 0:
            raise ValueError(f"the Responses API has one output: a delta of choice {d.index}")
        frames = []
        if not self._running:
            self._running = True
            frames.append(self._with_response("response.in_progress"))
        self._logprobs += d.logprobs or ()
        if d.text:
            frames += self._text(d.text)
        for piece in d.tools or ():
            frames += self._tool(piece)
        return frames

    def _text(self, text: str) -> list[Frame]:
        frames = []
        item = self._open
        if item is None or item.call is not None:
            frames += self._close("completed")
            item = self._add(None)
            frames.append(self._item_frame("response.output_item.added", item))
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            frames.append(self._part_frame("response.content_part.added", item, part))
        item.pieces.append(text)
        logprobs, self._logprobs = self._logprobs, []
        item.logprobs += logprobs
        frames.append(
            self._frame(
                "response.output_text.delta",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                delta=text,
                logprobs=[logprob(lp, raw=False) for lp in logprobs],
            )
        )
        return frames

    def _tool(self, piece: ToolFragment) -> list[Frame]:
        """A call's first piece opens its item; the others continue the open call. The
        Responses API keeps no logprobs on calls: those of the call's tokens are dropped."""
        frames = []
        self._logprobs = []
        item = self._open
        if piece.id is not None:
            if piece.name is None:
                raise ValueError(f"the first piece of call {piece.call} has no name")
            frames += self._close("completed")
            item = self._add(piece.call)
            item.call_id, item.name = piece.id, piece.name
            frames.append(self._item_frame("response.output_item.added", item))
        elif item is None or item.call != piece.call:
            raise ValueError(f"arguments of call {piece.call}, which is not the open item")
        if piece.arguments:
            item.pieces.append(piece.arguments)
            frames.append(
                self._frame(
                    "response.function_call_arguments.delta",
                    item_id=item.id,
                    output_index=item.index,
                    delta=piece.arguments,
                )
            )
        return frames

    def _finish(self, end: End) -> list[Frame]:
        if self._error is not None and end.state != State.ERRORED:
            raise ValueError(f"an Error, then an End in state {end.state!r}")
        final, status = ending(end)
        frames = []
        if self._logprobs and self._open is not None and self._open.call is None:
            frames += self._text("")  # the last tokens' logprobs (their text was held back)
        frames += self._close("completed" if status == "completed" else "incomplete")
        self._end = end
        frames.append(self._with_response(final))
        return frames

    def _add(self, call: int | None) -> Item:
        index = len(self._items)
        prefix = "msg" if call is None else "fc"
        item = Item(item_id(self.response_id, index, prefix), index, call)
        self._items.append(item)
        self._open = item
        return item

    def _close(self, status: str) -> list[Frame]:
        item, self._open = self._open, None
        if item is None:
            return []
        item.status = status
        if item.call is None:
            done = [logprob(lp, raw=False) for lp in item.logprobs]
            frames = [
                self._frame(
                    "response.output_text.done",
                    item_id=item.id,
                    output_index=item.index,
                    content_index=0,
                    text=item.text,
                    logprobs=done,
                ),
                self._part_frame("response.content_part.done", item, item.part()),
            ]
        else:
            frames = [
                self._frame(
                    "response.function_call_arguments.done",
                    item_id=item.id,
                    output_index=item.index,
                    name=item.name,
                    arguments=item.text,
                )
            ]
        frames.append(self._item_frame("response.output_item.done", item))
        return frames

    def _item_frame(self, type_: str, item: Item) -> Frame:
        added = type_ == "response.output_item.added"
        return self._frame(type_, output_index=item.index, item=item.render(added=added))

    def _part_frame(self, type_: str, item: Item, part: dict[str, Any]) -> Frame:
        return self._frame(
            type_, item_id=item.id, output_index=item.index, content_index=0, part=part
        )


def frames_after(
    renderer: ResponsesRenderer, events: Iterable[Event], after: int | None
) -> list[Frame]:
    """The frames of a log that a reader who saw up to sequence number ``after`` has not
    seen (``None``: all of them), from a fresh ``renderer``: resume is a filter."""
    if renderer.sequence_number != 0:
        raise ValueError("frames_after needs a renderer that has rendered nothing yet")
    floor = -1 if after is None else after
    return [f for e in events for f in renderer.feed(e) if f.sequence_number > floor]
