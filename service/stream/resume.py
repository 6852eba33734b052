"""Where a read of a request's log starts: the one decision every read path acts on.

A reader names a request and, maybe, a cursor; the route looks the log up (the hot log in
Redis, else the archive) and hands what it found here. The plan says what to do, and the
route does it -- the I/O and the HTTP answer stay there, the rules live here (the core
returns decisions, the caller acts on them):

``NotYours``       no log, another tenant's, or another kind's: the one 404 (nothing tells
                   them apart)
``UnknownCursor``  the cursor is no event of this request: a 400 ``invalid_event_id``
``NothingToSend``  nothing renders after the cursor and the log has ended (the cursor
                   is past the terminal event's last frame, or on an in-band error
                   whose end renders nothing): 204, the SSE standard's "stop
                   reconnecting"
``FromHotLog``     follow the hot log after the cursor, to its end
``FromArchive``    the whole log is in hand (archived, or ended): render it after the cursor

Two cursors: a chat or text completion's event id (``Last-Event-ID``, ``?after=``),
checked against the log (``event_plan``), and a response's sequence number
(``starting_after``), counted from the log's start -- past the end is simply nothing more,
so it is never refused (``sequence_plan``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Generic, TypeVar

from service.stream.events import Created, End, Event, Kind
from service.stream.ids import Cursor, EventId
from service.stream.render import ChunkRenderer, sse_event_frames

C = TypeVar("C", Cursor, int)


@dataclasses.dataclass(frozen=True, slots=True)
class Looked:
    """What a read path looked up: the log's first event (its ``Created``; None: no log),
    its last entry, whether the cursor's event is one of its entries, and where it was
    read -- ``hot``: Redis, where it may still grow; else the archive, whole."""

    first: Event | None
    last: tuple[EventId, Event] | None = None
    known: bool = False
    hot: bool = True
    before_last: tuple[EventId, Event] | None = None  # the entry before ``last``, if read

    @classmethod
    def whole(
        cls, entries: Sequence[tuple[EventId, Event]], cursor: Cursor | None, *, hot: bool = False
    ) -> Looked:
        """A log read entire (the archive's, or a whole hot read)."""
        if not entries:
            return cls(None, None, False, hot)
        known = cursor is not None and any(eid == cursor.event for eid, _ in entries)
        before_last = entries[-2] if len(entries) > 1 else None
        return cls(entries[0][1], entries[-1], known, hot, before_last)

    @property
    def ended(self) -> bool:
        return self.last is not None and isinstance(self.last[1], End)


@dataclasses.dataclass(frozen=True, slots=True)
class NotYours:
    """No such request for this caller: none, another tenant's, or not of the kind asked."""


@dataclasses.dataclass(frozen=True, slots=True)
class UnknownCursor:
    """The cursor is not an event of this request."""

    cursor: Cursor


@dataclasses.dataclass(frozen=True, slots=True)
class NothingToSend:
    """The client has it all: the log ended, and nothing renders after the cursor."""


@dataclasses.dataclass(frozen=True)  # (not slots: on 3.11 a slotted generic fails in X[int](...))
class FromHotLog(Generic[C]):
    """Follow the hot log after ``cursor`` (None: from the start) to its end."""

    created: Created
    cursor: C | None


@dataclasses.dataclass(frozen=True)  # (not slots: on 3.11 a slotted generic fails in X[int](...))
class FromArchive(Generic[C]):
    """The whole log is in hand: render it after ``cursor``; nothing more will come."""

    created: Created
    cursor: C | None


EventPlan = NotYours | UnknownCursor | NothingToSend | FromHotLog[Cursor] | FromArchive[Cursor]
SequencePlan = NotYours | FromHotLog[int] | FromArchive[int]


def owner(first: Event | None, tenant: str, kind: Kind | None = None) -> Created | None:
    """The request's ``Created`` if the log is the caller's tenant's (and of ``kind``)."""
    if not isinstance(first, Created) or first.tenant != tenant:
        return None
    if kind is not None and first.kind != kind:
        return None
    return first


def all_sent(rid: str, created: Created, looked: Looked, cursor: Cursor | None) -> bool:
    """The log has ended and nothing renders after the cursor: the client has it all.
    The cursor is on the terminal event, past its last frame -- or on the entry before it
    when the end renders nothing (an errored request: its last frame is the in-band error,
    and that is the id a client reconnects with)."""
    last = looked.last
    if cursor is None or last is None or not isinstance(last[1], End):
        return False
    if cursor.event == last[0]:
        tail = [last]
    elif looked.before_last is not None and cursor.event == looked.before_last[0]:
        tail = [looked.before_last, last]
    else:
        return False
    renderer = ChunkRenderer(rid, created)
    return not any(sse_event_frames(renderer, eid, event, cursor) for eid, event in tail)


def event_plan(rid: str, tenant: str, looked: Looked, cursor: Cursor | None) -> EventPlan:
    """A chat or text completion's stream after an event-id cursor. In this order: whose
    it is, then whether the cursor is its own, then whether anything is left to send."""
    created = owner(looked.first, tenant)
    if created is None:
        return NotYours()
    if cursor is not None:
        if not looked.known:
            return UnknownCursor(cursor)
        if all_sent(rid, created, looked, cursor):
            return NothingToSend()
    if looked.hot:
        return FromHotLog(created, cursor)
    return FromArchive(created, cursor)


def sequence_plan(
    tenant: str, looked: Looked, after: int | None, *, follow_ended: bool = True
) -> SequencePlan:
    """A response's events after sequence number ``after``: another tenant's or a request
    that is no response is not found; a hot log is followed -- unless it has ended and the
    reader renders what it read (``follow_ended=False``: a WebSocket's resume)."""
    created = owner(looked.first, tenant, Kind.RESPONSE)
    if created is None:
        return NotYours()
    if looked.hot and (follow_ended or not looked.ended):
        return FromHotLog(created, after)
    return FromArchive(created, after)
