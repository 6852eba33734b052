"""The resume plan (``service/stream/resume.py``): the rules every read path acts on,
stated over generated logs -- hot or archived, ended or not, of either tenant and any kind
-- and cursors on any of their frames or on none of their events.

- another tenant's request, a request of another kind, or no log: never streamed, whatever
  the cursor (the one 404);
- a cursor that is not an event of the request is refused, before anything else is said;
- nothing to send exactly when the cursor is on the terminal event, past its last frame:
  a client that has it all is told to stop, and one that lacks a frame is never told so;
- otherwise a stream after the cursor as given: from the hot log while it is there, else
  from the archive;
- a response's sequence number is never refused (past the end is simply nothing more).
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import given
from hypothesis import strategies as st

from service.stream import resume
from service.stream.events import Created, Delta, End, Error, Event, Kind
from service.stream.ids import Cursor, EventId, frame_ids
from service.stream.lifecycle import FinishReason, State
from service.stream.render import ChunkRenderer, sse_event_frames

RID = "chatcmpl-0123456789abcdef0123456789abcdef"
TENANTS = ("acme", "globex")
STOP = End(State.FINISHED, FinishReason.STOP, 3, 2)
FAILED = End(State.ERRORED, None, 3, 0)


@dataclass(frozen=True)
class Case:
    """A log as a read path finds it, and who asks with which cursor."""

    entries: list[tuple[EventId, Event]]
    hot: bool
    tenant: str  # the caller's
    cursor: Cursor | None

    @property
    def looked(self) -> resume.Looked:
        return resume.Looked.whole(self.entries, self.cursor, hot=self.hot)

    @property
    def created(self) -> Created | None:
        first = self.entries[0][1] if self.entries else None
        return first if isinstance(first, Created) else None

    @property
    def ended(self) -> bool:
        return bool(self.entries) and isinstance(self.entries[-1][1], End)

    def left(self) -> list[bytes]:
        """The frames a reader at the cursor has not seen, as the readers render them."""
        assert self.created is not None
        renderer = ChunkRenderer(RID, self.created)
        return [
            f for eid, e in self.entries for f in sse_event_frames(renderer, eid, e, self.cursor)
        ]


def _created(owner: str, kind: Kind, usage: bool) -> Created:
    return Created(kind, "m", 1, 3, include_usage=usage, tenant=owner)


@st.composite
def cases(draw: st.DrawFn) -> Case:
    owner, tenant = draw(st.sampled_from(TENANTS)), draw(st.sampled_from(TENANTS))
    created = _created(owner, draw(st.sampled_from(list(Kind))), draw(st.booleans()))
    texts = draw(st.lists(st.text(max_size=3), max_size=4))
    events: list[Event] = [created]
    events += [Delta(t, [i], i + 1) for i, t in enumerate(texts)]
    events += draw(st.sampled_from([[], [STOP], [Error("boom", "it broke"), FAILED]]))
    start = draw(st.sampled_from(["whole", "trimmed", "none"]))  # a log with no Created
    if start == "trimmed":
        events = events[1:]
    elif start == "none":
        events = []
    entries = [(EventId(1000 + i, draw(st.integers(0, 2))), e) for i, e in enumerate(events)]
    # a cursor on any frame of the log (as its SSE ids name them), or on no event of it
    ids = [c for eid, e in entries for c in frame_ids(eid, 3 if isinstance(e, End) else 1)]
    foreign = st.builds(Cursor, st.builds(EventId, st.integers(0, 999), st.integers(0, 3)))
    any_frame = st.builds(lambda c, f: Cursor(c.event, f), st.sampled_from(ids), st.integers(0, 4))
    choices = [st.none(), foreign] + ([st.sampled_from(ids), any_frame] if ids else [])
    cursor = draw(st.one_of(*choices))
    return Case(entries, draw(st.booleans()), tenant, cursor)


def _events() -> st.SearchStrategy[Event | None]:
    created = st.builds(
        _created, st.sampled_from(TENANTS), st.sampled_from(list(Kind)), st.booleans()
    )
    return st.one_of(
        st.none(),
        created,
        st.just(STOP),
        st.builds(Delta, st.text(max_size=2), st.just([1]), st.just(1)),
    )


# what a lookup may say, consistent or not (a log that moved on between two reads)
lookeds = st.builds(
    resume.Looked,
    _events(),
    st.one_of(
        st.none(),
        st.tuples(
            st.builds(EventId, st.integers(0, 3), st.integers(0, 2)),
            st.sampled_from([STOP, FAILED, Error("x", "y")]),
        ),
    ),
    st.booleans(),
    st.booleans(),
)
cursors = st.one_of(
    st.none(),
    st.builds(
        Cursor,
        st.builds(EventId, st.integers(0, 3), st.integers(0, 2)),
        st.one_of(st.none(), st.integers(0, 3)),
    ),
)


@given(lookeds, st.sampled_from(TENANTS), cursors, st.booleans())
def test_only_the_owners_request_is_ever_streamed_or_answered(
    looked: resume.Looked, tenant: str, cursor: Cursor | None, follow: bool
) -> None:
    """Whatever the lookup said and whatever the cursor: anything but the one 404 means
    the log's first event is the caller's tenant's ``Created`` (and, for a response's
    sequence cursor, a response); and then an unknown cursor is refused first."""
    first = looked.first
    mine = isinstance(first, Created) and first.tenant == tenant
    plan = resume.event_plan(RID, tenant, looked, cursor)
    assert isinstance(plan, resume.NotYours) == (not mine)
    if mine and cursor is not None and not looked.known:
        assert plan == resume.UnknownCursor(cursor)
    seq = resume.sequence_plan(tenant, looked, 7, follow_ended=follow)
    response = mine and isinstance(first, Created) and first.kind == Kind.RESPONSE
    assert isinstance(seq, resume.NotYours) == (not response)


@given(cases())
def test_another_tenants_request_is_never_streamed_whatever_the_cursor(case: Case) -> None:
    if case.created is not None and case.created.tenant == case.tenant:
        return
    assert resume.event_plan(RID, case.tenant, case.looked, case.cursor) == resume.NotYours()
    after = case.cursor.event.seq if case.cursor else None
    assert resume.sequence_plan(case.tenant, case.looked, after) == resume.NotYours()


@given(cases())
def test_a_cursor_that_is_not_the_requests_is_refused(case: Case) -> None:
    if case.created is None or case.created.tenant != case.tenant or case.cursor is None:
        return
    plan = resume.event_plan(RID, case.tenant, case.looked, case.cursor)
    ours = {eid for eid, _ in case.entries}
    assert isinstance(plan, resume.UnknownCursor) == (case.cursor.event not in ours)


@given(cases())
def test_nothing_to_send_exactly_when_the_client_has_the_whole_log(case: Case) -> None:
    """204 for a cursor on the terminal event past its last frame, or on the entry before
    it when nothing renders after (an errored request's end renders no frame: its last
    frame is the in-band error); never while a frame is left or the log may still grow;
    the stream after the cursor, as given, otherwise."""
    created = case.created
    if created is None or created.tenant != case.tenant:
        return
    plan = resume.event_plan(RID, case.tenant, case.looked, case.cursor)
    if isinstance(plan, resume.UnknownCursor):
        return
    tail = {eid for eid, _ in case.entries[-2:]}
    on_end = case.ended and case.cursor is not None and case.cursor.event in tail
    has_it_all = on_end and not case.left()
    assert isinstance(plan, resume.NothingToSend) == has_it_all
    if case.ended and case.cursor == Cursor(case.entries[-1][0]):  # the terminal event's id
        assert isinstance(plan, resume.NothingToSend)
    if not has_it_all:
        where = resume.FromHotLog if case.hot else resume.FromArchive
        assert plan == where(created, case.cursor)


@given(cases(), st.integers(0, 50), st.booleans())
def test_a_responses_sequence_cursor_is_never_refused(case: Case, after: int, follow: bool) -> None:
    created = case.created
    plan = resume.sequence_plan(case.tenant, case.looked, after, follow_ended=follow)
    if created is None or created.tenant != case.tenant or created.kind != Kind.RESPONSE:
        assert plan == resume.NotYours()
        return
    followed = case.hot and (follow or not case.ended)
    where = resume.FromHotLog if followed else resume.FromArchive
    assert plan == where(created, after)


def test_a_cursor_on_the_terminal_events_first_frame_still_gets_the_rest() -> None:
    """The worked example: an ended chat with usage renders its end as three frames; a
    client cut after the first of them gets the other two, one past the last gets 204."""
    created = _created("acme", Kind.CHAT, True)
    entries: list[tuple[EventId, Event]] = [(EventId(1, 0), created), (EventId(2, 0), STOP)]
    for cursor, expected in [
        (Cursor(EventId(2, 0), 0), resume.FromArchive(created, Cursor(EventId(2, 0), 0))),
        (Cursor(EventId(2, 0)), resume.NothingToSend()),
        (Cursor(EventId(2, 1)), resume.UnknownCursor(Cursor(EventId(2, 1)))),
    ]:
        looked = resume.Looked.whole(entries, cursor)
        assert resume.event_plan(RID, "acme", looked, cursor) == expected
        assert resume.event_plan(RID, "globex", looked, cursor) == resume.NotYours()


def test_a_cursor_on_the_in_band_error_of_an_ended_request_is_told_to_stop() -> None:
    """An errored request's last frame is its in-band error (the end renders none): an
    EventSource reconnecting with that id gets 204 -- not an empty 200, after which it
    would reconnect for ever. While the log has not ended, it is followed as before."""
    created = _created("acme", Kind.CHAT, False)
    error = (EventId(2, 0), Error("boom", "it broke"))
    cursor = Cursor(EventId(2, 0))
    ended = resume.Looked.whole([(EventId(1, 0), created), error, (EventId(3, 0), FAILED)], cursor)
    assert resume.event_plan(RID, "acme", ended, cursor) == resume.NothingToSend()
    running = resume.Looked.whole([(EventId(1, 0), created), error], cursor, hot=True)
    assert resume.event_plan(RID, "acme", running, cursor) == resume.FromHotLog(created, cursor)
    earlier = Cursor(EventId(1, 0))  # the error is still to be sent
    looked = resume.Looked.whole(
        [(EventId(1, 0), created), error, (EventId(3, 0), FAILED)], earlier
    )
    assert resume.event_plan(RID, "acme", looked, earlier) == resume.FromArchive(created, earlier)
