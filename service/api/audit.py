"""What the stored-completions routes and the console show of a request: its row, what
was asked (the kept input), what was answered (its log, hot or archived), and the
timeline of its events. Who may see what: an operator-role key every tenant, any other
key its own tenant -- another tenant's request is the unknown id's 404."""

from __future__ import annotations

import datetime as dt
import math
from typing import Any

import msgspec
from litestar import Request

from service.api.auth import Principal
from service.api.context import Context
from service.api.request_ids import no_such_request
from service.errors import InvalidRequest, ServiceUnavailable
from service.ledger.audit import Audit, row_dict
from service.ledger.models import RequestRow
from service.stream import archive
from service.stream.events import Created, Delta, End, Error, Event
from service.stream.ids import EventId
from service.stream.render import ResponseAggregate

Entries = list[tuple[EventId, Event]]

# the request body's fields shown apart from its parameters
_INPUT_PARTS = ("messages", "prompt", "tools", "tool_choice", "response_format", "metadata")
_NOT_PARAMETERS = {*_INPUT_PARTS, "model", "stream", "store"}


def ledger_of(ctx: Context) -> Audit:
    if ctx.audit is None:
        raise ServiceUnavailable(
            "no Postgres is configured (LASTEVENT_DATABASE_URL): nothing is recorded",
            code="ledger_unavailable",
        )
    return ctx.audit


def is_operator(principal: Principal) -> bool:
    return principal.role == "operator"


def visible(principal: Principal, tenant: str) -> bool:
    return is_operator(principal) or tenant == principal.tenant


async def entries_of(ctx: Context, rid: str) -> Entries:
    """The request's log: the hot one while it lasts, else its archive (maybe none)."""
    entries = await ctx.log.read(rid)
    if entries and isinstance(entries[0][1], Created):
        return entries
    return (await ctx.ledger.archived(rid) or []) if ctx.ledger is not None else []


def unpacked(blob: bytes | None) -> Entries:
    return archive.unpack(blob) if blob else []


def completion_object(rid: str, entries: Entries, row: RequestRow) -> dict[str, Any]:
    """OpenAI's ``chat.completion`` of a stored completion (its answer from its log)."""
    created = entries[0][1] if entries else None
    if not isinstance(created, Created):  # no log left: the row alone
        return {
            "id": rid,
            "object": "chat.completion",
            "created": int(row.created_at.timestamp()),
            "model": row.model,
            "choices": [],
            "usage": _usage(row),
            "metadata": row.metadata_,
        }
    agg = ResponseAggregate(rid, created)
    for _, event in entries:
        agg.add(event)
    body = agg.response() if agg.end is not None else {"id": rid, "choices": []}
    return {**body, "metadata": row.metadata_, "request_id": rid}


def _usage(row: RequestRow) -> dict[str, int]:
    return {
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "total_tokens": row.total_tokens,
    }


def kept_body(created: Created) -> dict[str, Any] | None:
    """The request as the client sent it, when its input was kept."""
    if created.input is not None:
        body: dict[str, Any] = msgspec.json.decode(created.input)
        return body
    if created.response is not None:  # a response: its input items and parameters
        shown: dict[str, Any] = msgspec.json.decode(created.response)
        return shown
    return None


def input_json(created: Created) -> dict[str, Any] | None:
    """What was asked, for the console: the conversation (or prompt, or a response's
    input), tools and formats, and every other field as ``parameters``."""
    body = kept_body(created)
    if body is None:
        return None
    out = {k: body[k] for k in _INPUT_PARTS if k in body}
    out["parameters"] = {k: v for k, v in body.items() if k not in _NOT_PARAMETERS}
    if created.response is not None and created.input is None:
        out = {**body}
    out.setdefault("metadata", created.metadata)
    return out


def messages_of(rid: str, created: Created) -> list[dict[str, Any]]:
    """A stored completion's input messages, each with an id (OpenAI's ``messages.list``)."""
    body = kept_body(created) or {}
    return [{**m, "id": f"{rid}-{i}"} for i, m in enumerate(body.get("messages") or [])]


def timeline(entries: Entries) -> list[dict[str, Any]]:
    """Each event: its id and time, and what it carried (the console's chart and list)."""
    out = []
    for eid, event in entries:
        item: dict[str, Any] = {
            "id": str(eid),
            "t_ms": eid.ms,
            "type": type(event).__name__.lower(),
        }
        if isinstance(event, Delta):
            item.update(index=event.index, chars=len(event.text), tokens=event.consumed)
            if event.by is not None:
                item.update(worker=event.by, how=event.how)
        elif isinstance(event, Error):
            item.update(code=event.code, message=event.message)
        elif isinstance(event, End):
            item.update(state=str(event.state), finish_reason=event.finish_reason)
        out.append(item)
    return out


def output_json(rid: str, entries: Entries) -> list[dict[str, Any]]:
    created = entries[0][1] if entries else None
    if not isinstance(created, Created):
        return []
    agg = ResponseAggregate(rid, created)
    for _, event in entries:
        agg.add(event)
    reasons = (agg.end.finish_reasons or [agg.end.finish_reason]) if agg.end else []
    return [
        {
            "index": i,
            "text": "".join(c.parts),
            "tool_calls": list(c.calls.values()) or None,
            "finish_reason": reasons[i] if i < len(reasons) else None,
        }
        for i, c in enumerate(agg.choices)
    ]


async def request_page(ctx: Context, principal: Principal, rid: str) -> dict[str, Any]:
    """The console's request page: row, input, output, events; the unknown id's 404 for
    another tenant's request (as for one that never existed)."""
    row = await ledger_of(ctx).request(rid)
    if row is not None and not visible(principal, row.tenant):
        raise no_such_request(rid)
    entries = await entries_of(ctx, rid)
    created = entries[0][1] if entries else None
    if row is None and not (isinstance(created, Created) and visible(principal, created.tenant)):
        raise no_such_request(rid)
    return {
        "request": row_dict(row) if row is not None else None,
        "input": input_json(created) if isinstance(created, Created) else None,
        "output": output_json(rid, entries),
        "events": timeline(entries),
        "live": row is None,
    }


def texts(**params: str | None) -> None:
    """A 400 for a query parameter Postgres could not take as text (a NUL), not a 500."""
    for name, value in params.items():
        if value is not None and "\x00" in value:
            raise InvalidRequest(f"{name} holds a NUL character", param=name)


def metadata_filter(request: Request[Any, Any, Any]) -> dict[str, str] | None:
    """``metadata[key]=value`` query parameters (how OpenAI's SDKs send a dict)."""
    found: dict[str, str] = {}
    for name, value in request.query_params.items():
        if name.startswith("metadata[") and name.endswith("]"):
            texts(metadata=name + value)
            found[name[len("metadata[") : -1]] = value
    return found or None


def bounded_limit(raw: int | None, default: int, most: int) -> int:
    limit = default if raw is None else raw
    if not 1 <= limit <= most:
        raise InvalidRequest(f"limit must be between 1 and {most}", param="limit")
    return limit


def moment(raw: str | None, param: str) -> dt.datetime | None:
    """An instant: ISO 8601 (UTC unless it says otherwise) or unix seconds."""
    if raw is None or raw == "":
        return None
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    try:
        if math.isfinite(seconds):
            return dt.datetime.fromtimestamp(seconds, tz=dt.UTC)
        when = dt.datetime.fromisoformat(raw)
        if when.tzinfo is None:
            when = when.replace(tzinfo=dt.UTC)
        # in UTC here: an offset can carry it past year 1 or 9999, which Postgres' driver
        # refused with a 500 ("0001-01-01T00:00+23:59")
        return when.astimezone(dt.UTC)
    except (ValueError, OverflowError, OSError):
        shown = raw[:40]
        raise InvalidRequest(
            f"{param} is {shown!r}: use ISO 8601 or unix seconds (years 1 to 9999 in UTC)",
            param=param,
        ) from None
