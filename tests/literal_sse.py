"""A literal parser of OpenAI's stream framing, the way ``vllm bench serve`` and many
hand-written clients read it: split at blank lines, skip what starts with ``:``, take
the rest as ``data: <json>`` (or ``[DONE]``); anything else fails its ``json.loads``."""

from __future__ import annotations

import json
from typing import Any


def literal_messages(body: bytes) -> list[Any]:
    """Every message of ``body`` as such a client decodes it (``"[DONE]"`` as a string);
    raises where it would (a ``retry:`` or ``id:`` line is not JSON)."""
    out: list[Any] = []
    for raw in body.decode().split("\n\n"):
        message = raw.strip()
        if not message or message.startswith(":"):
            continue
        if message.startswith("event: "):  # a Responses stream names its event first
            _, _, message = message.partition("\n")
        chunk = message.removeprefix("data: ")
        out.append(chunk if chunk == "[DONE]" else json.loads(chunk))
    return out
