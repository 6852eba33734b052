"""A response's output items as the Responses API shows them: a message (its text, with
the tokens' logprobs) or a function call (its arguments), each with an id that every
rendering of the log gives it again."""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

from service.stream.logprobs import Logprob


def item_id(response_id: str, output_index: int, prefix: str) -> str:
    """The same id on every rendering of the log: a digest of the response and place."""
    digest = hashlib.sha256(f"{response_id}/{output_index}".encode()).hexdigest()
    return f"{prefix}_{digest[:48]}"


def logprob(lp: Logprob, *, raw: bool) -> dict[str, Any]:
    """A token's logprob: in deltas and ``.done`` events without bytes, in the
    response's ``output_text`` part with them (OpenAI's two shapes)."""

    def one(token: str, data: bytes, logprob: float) -> dict[str, Any]:
        if raw:
            return {"token": token, "bytes": list(data), "logprob": logprob}
        return {"token": token, "logprob": logprob}

    top = [one(a.token, a.raw, a.logprob) for a in lp.top]
    return {**one(lp.token, lp.raw, lp.logprob), "top_logprobs": top}


@dataclasses.dataclass(slots=True)
class Item:
    """One output item: a message (its text's pieces) or a function call (its arguments')."""

    id: str
    index: int  # its output_index
    call: int | None = None  # the ToolFragment's call index; None: a message
    call_id: str = ""
    name: str = ""
    status: str = "in_progress"
    pieces: list[str] = dataclasses.field(default_factory=list)
    logprobs: list[Logprob] = dataclasses.field(default_factory=list)

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    def part(self) -> dict[str, Any]:
        logprobs = [logprob(lp, raw=True) for lp in self.logprobs]
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": logprobs}

    def render(self, *, added: bool = False) -> dict[str, Any]:
        """The item as JSON, a new object each time (frames keep what they were given);
        ``added``: as ``output_item.added`` shows it, before any of its content."""
        if self.call is None:
            content = [] if added else [self.part()]
            return {
                "id": self.id,
                "type": "message",
                "status": self.status,
                "role": "assistant",
                "content": content,
            }
        return {
            "id": self.id,
            "type": "function_call",
            "status": self.status,
            "arguments": "" if added else self.text,
            "call_id": self.call_id,
            "name": self.name,
        }
