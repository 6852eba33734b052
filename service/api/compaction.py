"""``POST /v1/responses/compact`` (Open Responses' compaction): the conversation so far,
summarised by the served model into one ``compaction`` item that a later request sends
back as input in place of the turns it stands for.

The summary is a response like any other (the same log, worker, billing row), asked of
the model with an instruction to summarise and ``store: false``; its text becomes the
item's ``encrypted_content``. lastevent has no hidden model state to seal, so the
content is the summary as written: a client may read it. As input, a ``compaction``
item becomes a user turn that says it is the summary of the earlier conversation
(``response_input.py``).
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from litestar import Request, Response
from litestar.response import Stream
from msgspec import Meta

from service.api import answers, intake
from service.api.auth import Principal
from service.api.context import Context
from service.api.schemas import ResponsesRequest
from service.api.submit import accept
from service.errors import ApiError, InvalidRequest
from service.stream.response_items import item_id

SUMMARY_TOKENS = 512  # the summary's budget
INSTRUCTIONS = (
    "You compact conversations. Summarise the conversation so far for whoever continues "
    "it: the facts, names, numbers, decisions and open questions it needs. Write only the "
    "summary."
)
ASK = "Summarise the conversation above."


class CompactRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Open Responses' ``CompactResponseMethodPublicBody``."""

    model: str
    input: str | list[dict[str, Any]] | None = None
    previous_response_id: str | None = None
    instructions: str | None = None  # what the conversation ran under (kept in the summary)
    prompt_cache_key: Annotated[str, Meta(max_length=64)] | None = None  # (no prompt cache)


def summary_request(body: CompactRequest) -> ResponsesRequest:
    """The response that asks the model for the summary: the conversation, then the ask."""
    if isinstance(body.input, str):
        items: list[dict[str, Any]] = [{"type": "message", "role": "user", "content": body.input}]
    else:
        items = list(body.input or [])
    if body.instructions:
        said = f"The conversation ran under these instructions: {body.instructions}"
        items.insert(0, {"type": "message", "role": "user", "content": said})
    items.append({"type": "message", "role": "user", "content": ASK})
    return ResponsesRequest(
        model=body.model,
        input=items,
        instructions=INSTRUCTIONS,
        max_output_tokens=SUMMARY_TOKENS,
        store=False,
        previous_response_id=body.previous_response_id,
    )


async def compact(
    ctx: Context, request: Request[Any, Any, Any], principal: Principal, body: CompactRequest
) -> Response[Any]:
    """The compacted conversation (``CompactResource``), or the summary's error as is."""
    if body.input is None and body.previous_response_id is None:
        raise InvalidRequest("nothing to compact: give 'input' or 'previous_response_id'")
    asked = summary_request(body)
    sub = await intake.response(ctx, asked, principal)
    acc = await accept(ctx, sub, principal, None)
    answered = await answers.response(ctx, request, acc, asked)
    if isinstance(answered, Stream):  # (not asked for: a non-streaming request)
        raise ApiError("the summary answered a stream")
    if answered.status_code not in (None, 200):  # (the client went away: as a response's)
        return answered
    summary = answered.content
    if not isinstance(summary, dict):  # (answers.response's object: a dict)
        raise ApiError("the summary answered no response object")
    if summary.get("status") not in ("completed", "incomplete"):
        raise ApiError("the summary failed: " + str((summary.get("error") or {}).get("message")))
    return Response(compacted(summary), headers=acc.headers)


def compacted(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary response as the compaction object: one ``compaction`` item."""
    rid: str = summary["id"]
    text = "".join(
        part.get("text", "")
        for item in summary["output"]
        if item.get("type") == "message"
        for part in item.get("content", [])
    )
    item = {"type": "compaction", "id": item_id(rid, 0, "cmp"), "encrypted_content": text}
    return {
        "id": rid,
        "object": "response.compaction",
        "created_at": summary["created_at"],
        "output": [item],
        "usage": summary["usage"],
    }
