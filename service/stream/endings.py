"""Every way a request ends, decided in one place.

An accepted request ends exactly once (``lifecycle.py``: finished, cancelled, abandoned,
errored). Whoever ends it -- the worker that ran it or failed while running it, the
sweeper, the API cancelling a queued request -- brings the facts and gets an ``Ending``:
the events the terminal append writes (the choices' last deltas, an in-band ``Error``
when it failed, the ``End`` last) and the billing ``Summary`` that goes to the outbox in
the same step, made from that ``End`` so that the two cannot disagree (and from the
``Created``: tenant, metadata, ...). The store's one terminal write takes it
(``RedisLog.end``); no other module builds an ``End`` or a ``Summary`` (the layout test).

How one choice stopped (``workers/decide.py`` asks as each choice of a run stops):

    the engine finished (EOS, a stop id)   finished  "stop"  ("tool_calls" if it made calls)
    the engine finished (max_tokens)       finished  "length"
    a stop string / the calls asked for    finished  "stop"  (whatever was decided after)
    a cancel / an abandon was decided      cancelled "cancelled" / abandoned "abandoned"
    engine error, deadline, lost log, ...  errored   (an in-band error, no finish_reason)

then the request's ending (``ran``): one choice's, or n > 1 choices merged (usage summed;
the first real error wins over the aborts it caused its siblings). Three outcomes of a
run end nothing: a request its stopping worker hands over (``HandOver``), one another
worker took (``FencedOut``), one whose readers are gone (``Park``: it waits out of the
engine for one to come back; ``window_over`` / ``cancelled_parked`` end it later).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from service.stream.events import Created, Delta, End, Error, Event, Summary
from service.stream.ids import EventId
from service.stream.lifecycle import ABORT_REASON, EngineFinish, FinishReason, State


@dataclasses.dataclass(frozen=True, slots=True)
class Recovery:
    """A continued request's counts: times its worker was lost (takeovers), times a stopping
    worker handed it over, tokens prefilled again to continue it; times it was parked (no
    reader), tokens made and thrown away then (made again: wasted), time spent parked, and
    when a reader last came back to it (unix ms; 0: never)."""

    takeovers: int = 0
    handovers: int = 0
    reprefill_tokens: int = 0
    parks: int = 0
    discarded_tokens: int = 0
    paused_ms: int = 0
    returned_ms: int = 0


@dataclasses.dataclass(frozen=True, slots=True)
class Failure:
    """Why a request failed: its in-band error, and the billing row's ``error_code``."""

    code: str
    message: str
    billed_as: str | None = None  # the row's code, when it is not ``code``

    @property
    def error_code(self) -> str:
        return self.billed_as or self.code


DEADLINE = "deadline"  # the billing row's code of a request past its deadline


def deadline(seconds: float) -> Failure:
    return Failure("deadline_exceeded", f"request exceeded its deadline of {seconds:g} s", DEADLINE)


ENGINE_ABORTED = Failure("engine_aborted", "the engine aborted the request")
INTERNAL = Failure("internal_error", "the worker failed while serving this request")
LOG_GAP = Failure(
    "log_lost", "Redis lost part of this request's log (it restarted without all of its data)"
)
LOG_LOST = Failure(
    "log_lost", "the request's log was lost (Redis restarted without its data); send it again"
)


@dataclasses.dataclass(frozen=True, slots=True)
class ChoiceEnd:
    """How one choice stopped: its state and finish reason, the tokens it consumed, its
    last deltas not yet in the log, and the tokens made before an abort decision."""

    index: int
    state: State  # a terminal state, or ``parked``
    finish_reason: FinishReason | None
    completion_tokens: int
    tail: tuple[Event, ...] = ()
    covered_tokens: int | None = None  # None: no abort was decided
    failure: Failure | None = None  # ``errored``: why
    logged_tokens: int = 0  # of ``completion_tokens``, those its deltas (tail too) carry


@dataclasses.dataclass(frozen=True, slots=True)
class HandOver:
    """No ending here: the stopping worker queues the request again for another worker;
    ``tail``: finished choices' last deltas, to go in the log first."""

    tail: tuple[Event, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class FencedOut:
    """No ending here: another worker owns the request now (it took it over)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Park:
    """No ending here: no reader is left, so the request leaves the engine and waits for one
    to come back (within its resume window); ``tail``: finished choices' last deltas, to go
    in the log first; ``discarded_tokens``: what was made and is not in the log (whoever
    continues it makes them again: wasted)."""

    tail: tuple[Event, ...] = ()
    discarded_tokens: int = 0


FENCED_OUT = FencedOut()
Stopped = ChoiceEnd | HandOver | FencedOut  # how a choice's run came to a stop

_ENGINE_REASON = {EngineFinish.STOP: FinishReason.STOP, EngineFinish.LENGTH: FinishReason.LENGTH}


@dataclasses.dataclass(frozen=True, slots=True)
class Shown:
    """What one choice came to when it stopped: whether a stop string or the calls asked
    for ended it (``stopped``), whether it made tool calls, the tokens it consumed."""

    index: int
    stopped: bool
    calls: bool
    completion_tokens: int
    logged_tokens: int = 0  # of them, those its logged deltas carry


def finished(
    shown: Shown,
    engine: EngineFinish | None,
    *,
    tail: Sequence[Event] = (),
    covered_tokens: int | None = None,
) -> ChoiceEnd:
    """The choice ran to its end: the engine's reason (``None``: it said none), "stop"
    where a stop string completed or the calls asked for are complete, and "tool_calls"
    for a choice that made calls and stopped."""
    assert engine != EngineFinish.ABORT, "an engine's own abort is a failure"
    reason = FinishReason.STOP if shown.stopped else _ENGINE_REASON.get(engine) if engine else None
    if reason == FinishReason.STOP and shown.calls:
        reason = FinishReason.TOOL_CALLS
    return ChoiceEnd(
        shown.index,
        State.FINISHED,
        reason,
        shown.completion_tokens,
        tuple(tail),
        covered_tokens,
        logged_tokens=shown.logged_tokens + sum(e.consumed for e in tail if isinstance(e, Delta)),
    )


def aborted(shown: Shown, decided: State, covered: int) -> ChoiceEnd:
    """A cancel, an abandon or a park (``decided``) stopped the choice, ``covered`` tokens
    in -- unless a stop string had ended it first (then it finished "stop")."""
    if shown.stopped:
        return finished(shown, None, covered_tokens=covered)
    reason = ABORT_REASON.get(decided)
    return ChoiceEnd(
        shown.index,
        decided,
        reason,
        shown.completion_tokens,
        covered_tokens=covered,
        logged_tokens=shown.logged_tokens,
    )


def failed_choice(
    index: int, failure: Failure, completion_tokens: int, logged_tokens: int = 0
) -> ChoiceEnd:
    return ChoiceEnd(
        index, State.ERRORED, None, completion_tokens, failure=failure, logged_tokens=logged_tokens
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Request:
    """What every ending of one request needs besides how it stopped."""

    request_id: str
    first: tuple[EventId, Created] | None  # the log's ``created`` (None: it is gone)
    prompt_tokens: int
    now_ms: int  # when it ends (the created time, where ``first`` is gone)
    recovery: Recovery = Recovery()
    worker_id: str | None = None
    dispatched_ms: int | None = None
    first_token_ms: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class Ending:
    """A request's ending: what its terminal append writes (``End`` last), and the
    billing summary that goes to the outbox with it."""

    events: tuple[Event, ...]
    summary: Summary

    @property
    def end(self) -> End:
        last = self.events[-1]
        assert isinstance(last, End)
        return last

    @property
    def state(self) -> State:
        return self.end.state


def wants_delivery(choices: Sequence[Stopped]) -> bool:
    """Whether the request's ending counts what its readers got (``ran``'s ``delivered``):
    abandoned, nobody came back, so what no reader got is wasted. Any other ending is in
    the log for the hot TTL, for a client between connections to read (billed as
    delivered)."""
    ends = [c for c in choices if isinstance(c, ChoiceEnd)]
    return len(ends) == len(choices) and _state(ends) == State.ABANDONED


def ran(
    request: Request,
    choices: Sequence[Stopped],
    *,
    delivered: int | None = None,
) -> Ending | HandOver | FencedOut | Park:
    """The ending of a run, from how each of its choices stopped (in choice order).
    ``delivered``: the most completion tokens any reader got, when none is left (see
    ``wants_delivery``; None: a reader is there, or it is not known)."""
    if any(isinstance(c, FencedOut) for c in choices):
        return FENCED_OUT
    ends = [c for c in choices if isinstance(c, ChoiceEnd)]
    if len(ends) < len(choices):  # a choice was handed over: the rest end with it
        return HandOver(tuple(e for c in ends for e in c.tail))
    total = sum(c.completion_tokens for c in ends)
    failures = [c.failure for c in ends if c.failure is not None]
    if failures:  # the engine's own error first, not a sibling's abort that it caused
        failure = min(failures, key=lambda f: f.code == ENGINE_ABORTED.code)
        return _ending(request, State.ERRORED, None, total, failure=failure)
    if any(c.state == State.PARKED for c in ends):  # no reader: the rest wait with it
        discarded = sum(c.completion_tokens - c.logged_tokens for c in ends)
        return Park(tuple(e for c in ends for e in c.tail), discarded)
    covered = None
    if any(c.covered_tokens is not None for c in ends):
        covered = sum(
            c.completion_tokens if c.covered_tokens is None else c.covered_tokens for c in ends
        )
    reasons = [c.finish_reason for c in ends]
    state = _state(ends)
    return _ending(
        request,
        state,
        ABORT_REASON.get(state, reasons[0]),
        total,
        tail=[e for c in ends for e in c.tail],
        wasted=wasted_tokens(total, covered, delivered),
        finish_reasons=reasons if len(ends) > 1 else None,
    )


def failed(request: Request, failure: Failure, completion_tokens: int) -> Ending:
    """A request its worker could not finish (it failed, or Redis lost part of its log),
    or whose workers were lost (the sweeper): errored, with ``completion_tokens`` (what
    its log reached)."""
    return _ending(request, State.ERRORED, None, completion_tokens, failure=failure)


def cancelled_queued(request: Request) -> Ending:
    """Cancelled while still queued: no engine saw it, nothing was generated."""
    return _ending(request, State.CANCELLED, FinishReason.CANCELLED, 0)


def window_over(request: Request, logged_tokens: int, delivered: int) -> Ending:
    """A parked request nobody came back to within its resume window: abandoned, billed
    for what was made (``logged_tokens``, what its log carries, and what was thrown away
    when it was parked); wasted: what no reader got."""
    completion = logged_tokens + request.recovery.discarded_tokens
    wasted = logged_tokens - min(delivered, logged_tokens)
    reason = FinishReason.ABANDONED
    return _ending(
        request,
        State.ABANDONED,
        reason,
        completion,
        wasted=wasted,
        finish_reasons=_all(request, reason),
    )


def cancelled_parked(request: Request, logged_tokens: int) -> Ending:
    """A parked request cancelled: billed for what was made; wasted: what was thrown away
    when it was parked (what its log carries is there to read)."""
    completion = logged_tokens + request.recovery.discarded_tokens
    reason = FinishReason.CANCELLED
    return _ending(
        request, State.CANCELLED, reason, completion, finish_reasons=_all(request, reason)
    )


def _all(request: Request, reason: FinishReason) -> list[FinishReason | None] | None:
    """Every choice's finish reason, the same for all (an ending none of them reached)."""
    n = request.first[1].n if request.first is not None else 1
    return [reason] * n if n > 1 else None


def lost(request: Request) -> Ending:
    """Redis lost the whole request: nothing can be written to its log, but the ledger
    gets an ``errored`` row (the summary alone, through an outbox entry of its own)."""
    return _ending(request, State.ERRORED, None, 0, failure=LOG_GAP)


def lost_in_band() -> list[Event]:
    """What a reader shows in place of the rest of a log that Redis lost under it."""
    return [Error(LOG_LOST.code, LOG_LOST.message), End(State.ERRORED, None, 0, 0)]


def wasted_tokens(completion: int, covered: int | None, delivered: int | None) -> int:
    """Tokens generated that no reader got.

    ``covered``: tokens made before an abort decision (``None``: no abort, all count);
    ``delivered``: the most tokens any reader's connection was sent, when no reader is
    left at the end (``None``: a reader is still there and gets the rest)."""
    kept = completion if covered is None else covered
    if delivered is not None:
        kept = min(kept, delivered)
    return max(0, completion - kept)


def _state(ends: Sequence[ChoiceEnd]) -> State:
    """The request's state: its choices', or -- some finished before a cancel or an
    abandon stopped the others -- that decision's (each choice keeps its own reason)."""
    states = {c.state for c in ends}
    decided = states & ABORT_REASON.keys()
    if len(states) > 1:
        return next(iter(decided)) if decided else State.FINISHED
    return next(iter(states))


def _ending(
    request: Request,
    state: State,
    reason: FinishReason | None,
    completion_tokens: int,
    *,
    failure: Failure | None = None,
    tail: Sequence[Event] = (),
    wasted: int = 0,
    finish_reasons: list[FinishReason | None] | None = None,
) -> Ending:
    recovery = request.recovery
    end = End(
        state=state,
        finish_reason=reason,
        prompt_tokens=request.prompt_tokens,
        completion_tokens=completion_tokens,
        # and what was made and thrown away when it was parked (made again, or not)
        wasted_tokens=wasted + recovery.discarded_tokens,
        takeovers=recovery.takeovers,
        handovers=recovery.handovers,
        reprefill_tokens=recovery.reprefill_tokens,
        finish_reasons=finish_reasons,
    )
    error = [Error(failure.code, failure.message)] if failure is not None else []
    created_id, created = request.first if request.first is not None else (None, None)
    summary = Summary(
        request_id=request.request_id,
        kind=created.kind if created else "",
        model=created.model if created else "",
        created_ms=created_id.ms if created_id is not None else request.now_ms,
        state=end.state,
        finish_reason=end.finish_reason,
        prompt_tokens=end.prompt_tokens,
        completion_tokens=end.completion_tokens,
        wasted_tokens=end.wasted_tokens,
        dispatched_ms=request.dispatched_ms,
        first_token_ms=request.first_token_ms,
        error_code=failure.error_code if failure is not None else None,
        worker_id=request.worker_id,
        tenant=created.tenant if created else None,
        api_key_id=created.api_key_id if created else None,
        takeovers=end.takeovers,
        handovers=end.handovers,
        reprefill_tokens=end.reprefill_tokens,
        user=created.user if created else None,
        store=created.store if created else True,
        metadata=created.metadata if created else None,
        listed=created.listed if created else False,
    )
    return Ending((*tail, *error, end), summary)
