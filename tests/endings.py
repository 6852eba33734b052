"""Endings for tests that write a log's end by hand: the ``End`` they choose, with the
billing summary that agrees with it (production code gets both from
``service/stream/endings.py``, the one place that makes them)."""

from __future__ import annotations

from service.stream import events as ev
from service.stream.endings import Ending
from service.stream.ids import EventId


def summary(
    request_id: str, end: ev.End, first: tuple[EventId, ev.Created] | None = None
) -> ev.Summary:
    created = first[1] if first is not None else None
    return ev.Summary(
        request_id=request_id,
        kind=created.kind if created else "chat",
        model=created.model if created else "m",
        created_ms=first[0].ms if first is not None else 0,
        state=end.state,
        finish_reason=end.finish_reason,
        prompt_tokens=end.prompt_tokens,
        completion_tokens=end.completion_tokens,
        tenant=created.tenant if created else None,
        api_key_id=created.api_key_id if created else None,
    )


def ending(request_id: str, *events: ev.Event) -> Ending:
    """``events`` (the ``End`` last) as a request's ending."""
    end = events[-1]
    assert isinstance(end, ev.End)
    return Ending(tuple(events), summary(request_id, end))
