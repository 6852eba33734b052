"""The worker's per-step decision and the endings it leads to, without an engine.

``ChoiceRun.step`` takes one engine output and the request's control signals and returns
what to do (append, abort the engine, the choice is over and how); ``endings.ran`` turns
how every choice stopped into the request's one ending. The property: for any sequence
of engine outputs, cancels, lapsed leases, handovers and failures, every choice stops
exactly once, the request ends in exactly one way, and an ending's events and billing
summary agree (with each other, with the tokens the engine made, with the signals sent).
"""

from __future__ import annotations

import dataclasses

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from service.stream import endings
from service.stream.assemble import Assembler
from service.stream.endings import (
    ChoiceEnd,
    Ending,
    FencedOut,
    HandOver,
    Park,
    Recovery,
    Stopped,
)
from service.stream.events import Created, Delta, End, Error, Event
from service.stream.ids import EventId
from service.stream.lifecycle import ABORT_REASON, EngineFinish, FinishReason, State
from service.tokenize import ModelInfo
from tests.unit.conftest import VOCAB_SIZE
from workers.decide import Action, ChoiceRun, Signals
from workers.engines.base import StepOutput

PROPS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
PROMPT = 5
CREATED = (EventId(1_000, 0), Created(kind="chat", model="m", created=1, prompt_tokens=PROMPT))


def choice(model: ModelInfo, index: int = 0, stop: tuple[str, ...] = ()) -> ChoiceRun:
    asm = Assembler(
        model.tokenizer,
        prompt_tokens=PROMPT,
        stop=stop,
        stop_token_ids=model.eos_token_ids,
        index=index,
    )
    return ChoiceRun(asm, index, stop_ids=model.eos_token_ids, ignore_eos=False)


def request(recovery: Recovery | None = None) -> endings.Request:
    recovery = recovery or Recovery()
    return endings.Request("chatcmpl-x", CREATED, PROMPT, 2_000, recovery, "w1", 1_500, 1_600)


def out(ids: list[int], reason: EngineFinish | None = None) -> StepOutput:
    return StepOutput(ids, finished=reason is not None, finish_reason=reason)


# -- one step at a time ----------------------------------------------------------------


def test_text_is_appended_and_the_engine_goes_on(tiny_model: ModelInfo) -> None:
    run = choice(tiny_model)
    action = run.step(out(tiny_model.encode("Hello")), Signals())
    assert [type(e) for e in action.append] == [Delta] and not action.abort
    assert action.stop is None


def test_a_stop_string_aborts_the_engine_and_finishes_stop(tiny_model: ModelInfo) -> None:
    run = choice(tiny_model, stop=("fox",))
    action = run.step(out(tiny_model.encode("The quick brown fox jumps")), Signals())
    assert action.abort and isinstance(action.stop, ChoiceEnd)
    assert (action.stop.state, action.stop.finish_reason) == (State.FINISHED, FinishReason.STOP)
    assert "".join(e.text for e in action.append if isinstance(e, Delta)) == "The quick brown "


def test_the_engines_length_is_length_and_held_text_is_released(tiny_model: ModelInfo) -> None:
    run = choice(tiny_model, stop=("fox!",))
    first = run.step(out(tiny_model.encode("a fo")), Signals())  # "fo" may become "fox!"
    last = run.step(out([], EngineFinish.LENGTH), Signals())
    assert isinstance(last.stop, ChoiceEnd) and last.stop.finish_reason == FinishReason.LENGTH
    shown = [*first.append, *last.append, *last.stop.tail]
    assert "".join(e.text for e in shown if isinstance(e, Delta)) == "a fo"


def test_a_cancel_counts_what_the_engine_still_makes_and_ends_cancelled(
    tiny_model: ModelInfo,
) -> None:
    run = choice(tiny_model)
    signals = Signals()
    run.step(out(tiny_model.encode("Hello")), signals)
    made = run.completion_tokens
    signals.decided = State.CANCELLED
    assert run.step(out([7, 8]), signals) == Action()  # counted, never shown
    action = run.step(out([9], EngineFinish.ABORT), signals)
    assert isinstance(action.stop, ChoiceEnd) and action.stop.state == State.CANCELLED
    assert action.stop.covered_tokens == made
    assert action.stop.completion_tokens == made + 3
    ending = endings.ran(request(), [action.stop])
    assert isinstance(ending, Ending)
    assert ending.end.wasted_tokens == 3
    assert ending.end.finish_reason == FinishReason.CANCELLED


def test_an_engine_abort_nobody_asked_for_is_an_error(tiny_model: ModelInfo) -> None:
    action = choice(tiny_model).step(out([], EngineFinish.ABORT), Signals())
    assert isinstance(action.stop, ChoiceEnd) and action.stop.state == State.ERRORED
    assert action.stop.failure == endings.ENGINE_ABORTED


def test_a_handover_stops_with_no_ending(tiny_model: ModelInfo) -> None:
    action = choice(tiny_model).step(out([5]), Signals(handing_over=True))
    assert action.stop == HandOver()


def test_a_deadline_aborts_the_engine_and_bills_deadline(tiny_model: ModelInfo) -> None:
    action = choice(tiny_model).failed(endings.deadline(600), abort=True)
    assert action.abort and isinstance(action.stop, ChoiceEnd)
    ending = endings.ran(request(), [action.stop])
    assert isinstance(ending, Ending)
    assert ending.summary.error_code == "deadline"
    assert ending.events[0] == Error("deadline_exceeded", "request exceeded its deadline of 600 s")


def test_a_choice_continued_from_a_log_that_ends_in_eos_is_over(tiny_model: ModelInfo) -> None:
    first = choice(tiny_model)
    ids = [*tiny_model.encode("Hi"), tiny_model.eos_token_ids[0]]
    logged = [e for e in first.step(out(ids), Signals()).append if isinstance(e, Delta)]
    asm, now = Assembler.resume(
        tiny_model.tokenizer, logged, prompt_tokens=PROMPT, stop_token_ids=tiny_model.eos_token_ids
    )
    run = ChoiceRun(asm, 0, stop_ids=tiny_model.eos_token_ids, ignore_eos=False)
    action = run.resumed(now)
    assert isinstance(action.stop, ChoiceEnd) and action.stop.finish_reason == FinishReason.STOP


def test_choices_merge_and_the_real_error_wins(tiny_model: ModelInfo) -> None:
    broken = endings.failed_choice(0, endings.ENGINE_ABORTED, 2)
    real = endings.failed_choice(1, endings.Failure("engine_error", "boom"), 3)
    ending = endings.ran(request(), [broken, real])
    assert isinstance(ending, Ending) and ending.summary.error_code == "engine_error"
    assert ending.end.completion_tokens == 5
    done = endings.finished(endings.Shown(0, False, False, 4), EngineFinish.LENGTH)
    handed = endings.ran(request(), [done, HandOver()])
    assert isinstance(handed, HandOver)
    assert isinstance(endings.ran(request(), [done, endings.FENCED_OUT]), FencedOut)


def test_a_cancel_that_stopped_some_choices_cancels_the_request() -> None:
    """One choice finished before the cancel, the other was cut by it: the request is
    cancelled (what the client asked for, and what is billed); each choice keeps its own
    finish reason. (Found by the property below: it was ``finished`` with the finish
    reason ``cancelled``.)"""
    done = endings.finished(endings.Shown(0, False, False, 4), EngineFinish.STOP)
    cut = endings.aborted(endings.Shown(1, False, False, 3), State.CANCELLED, 2)
    ending = endings.ran(request(), [done, cut])
    assert isinstance(ending, Ending)
    assert (ending.state, ending.end.finish_reason) == (State.CANCELLED, FinishReason.CANCELLED)
    assert ending.end.finish_reasons == [FinishReason.STOP, FinishReason.CANCELLED]


# -- any sequence ----------------------------------------------------------------------

ids = st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=4)
engine_step = st.tuples(
    st.just("out"),
    st.integers(0, 2),
    ids,
    st.sampled_from([None, None, None, *EngineFinish]),
)
signal = st.tuples(st.sampled_from(["cancel", "lapse", "park", "handover"]))
failure = st.tuples(st.sampled_from(["engine_error", "deadline", "fenced"]), st.integers(0, 2))
scripts = st.lists(st.one_of(engine_step, engine_step, engine_step, signal, failure), max_size=25)


@dataclasses.dataclass
class Driven:
    stops: list[Stopped]
    made: int  # the tokens the engine made for choices still running
    appended: list[Event]  # what the generation appended while running
    signals: Signals
    failed: bool
    fenced: bool


def drive(model: ModelInfo, n: int, script: list[tuple[object, ...]]) -> Driven:
    """Feed ``script`` to ``n`` choices as the generation loop does: an op for a choice
    that has stopped goes nowhere; a choice the script leaves running ends as when the
    engine's outputs run out."""
    runs = [choice(model, i, stop=("ab",)) for i in range(n)]
    stops: dict[int, Stopped] = {}
    signals = Signals()
    appended: list[Event] = []
    made = 0
    failed = fenced = False

    def apply(i: int, action: Action) -> None:
        appended.extend(action.append)
        if action.stop is not None:
            assert i not in stops, "a choice stops once"
            stops[i] = action.stop

    for op in script:
        kind = op[0]
        if kind == "cancel" and signals.decided is None:
            signals.decided = State.CANCELLED
        elif kind == "lapse" and signals.decided is None:
            signals.decided = State.ABANDONED
        elif kind == "park" and signals.decided is None:
            signals.decided = State.PARKED
        elif kind == "handover":
            signals.handing_over = True
        elif kind in ("out", "engine_error", "deadline", "fenced"):
            i = int(op[1]) % n  # type: ignore[call-overload]
            if i in stops:
                continue
            if kind == "out":
                step = out(list(op[2]), op[3])  # type: ignore[call-overload, arg-type]
                if signals.handing_over and signals.decided is None:
                    pass  # (stopped before it looks at the step)
                else:
                    made += len(step.token_ids)
                    # an abort nobody decided: the engine gave up on its own
                    failed |= step.finish_reason == EngineFinish.ABORT and not signals.decided
                apply(i, runs[i].step(step, signals))
            elif kind == "fenced":
                fenced = True
                apply(i, runs[i].fenced())
            else:
                failed = True
                f = endings.deadline(1) if kind == "deadline" else endings.Failure(kind, "boom")
                apply(i, runs[i].failed(f, abort=kind == "deadline"))
    for i, run in enumerate(runs):
        if i not in stops:
            apply(i, run.exhausted(signals))
    return Driven([stops[i] for i in range(n)], made, appended, signals, failed, fenced)


@PROPS
@given(n=st.integers(1, 3), script=scripts, delivered=st.none() | st.integers(0, 40))
# (found in CI: one choice's engine gave up on its own, then a park: the request errored,
# not parked -- a continuation would have run the failed choice again)
@example(n=2, script=[("out", 0, [3], EngineFinish.ABORT), ("park",)], delivered=None)
def test_any_sequence_ends_once_and_the_summary_agrees_with_the_events(
    tiny_model: ModelInfo, n: int, script: list[tuple[object, ...]], delivered: int | None
) -> None:
    driven = drive(tiny_model, n, script)
    recovery = Recovery(1, 0, 12)
    result = endings.ran(request(recovery), driven.stops, delivered=delivered)
    if isinstance(result, FencedOut):
        assert driven.fenced
        return
    if isinstance(result, HandOver):
        assert driven.signals.handing_over and not driven.fenced
        assert all(isinstance(e, Delta) for e in result.tail)
        return
    logged = [e for e in [*driven.appended, *getattr(result, "tail", ())] if isinstance(e, Delta)]
    if isinstance(result, Park):  # out of the engine: nothing ends, nothing is lost
        assert driven.signals.decided == State.PARKED and not driven.fenced
        assert all(isinstance(e, Delta) for e in result.tail)
        # what was made and is not in the log: made again when it goes on (wasted)
        assert result.discarded_tokens == driven.made - sum(len(d.token_ids) for d in logged)
        return
    assert isinstance(result, Ending)
    events, end, summary = result.events, result.end, result.summary
    # exactly one End, last; an error in band right before it iff it errored
    assert [i for i, e in enumerate(events) if isinstance(e, End)] == [len(events) - 1]
    errors = [e for e in events if isinstance(e, Error)]
    assert (errors != []) == (end.state == State.ERRORED) and len(errors) <= 1
    assert all(isinstance(e, Delta) for e in events[: len(events) - 1 - len(errors)])
    assert end.state.terminal
    # the summary is the End's
    assert (summary.state, summary.finish_reason) == (end.state, end.finish_reason)
    assert (summary.prompt_tokens, summary.completion_tokens) == (PROMPT, end.completion_tokens)
    assert (summary.wasted_tokens, summary.takeovers, summary.reprefill_tokens) == (
        end.wasted_tokens,
        1,
        12,
    )
    assert (summary.error_code is not None) == (end.state == State.ERRORED)
    # the tokens: every one the engine made is billed; what was shown never exceeds them
    assert end.completion_tokens == driven.made
    shown = [e for e in [*driven.appended, *events] if isinstance(e, Delta)]
    for i in range(n):
        counts = [d.n for d in shown if d.index == i]
        assert counts == sorted(counts)
    assert sum(len(d.token_ids) for d in shown) <= end.completion_tokens
    assert 0 <= end.wasted_tokens <= end.completion_tokens
    # the state says what happened, and the finish reason says the state
    if end.state == State.ERRORED:
        assert driven.failed and end.finish_reason is None
    elif end.state in ABORT_REASON:
        assert driven.signals.decided == end.state
        assert end.finish_reason == ABORT_REASON[end.state]
    else:
        assert end.finish_reason in (*FinishReason, None)
        assert end.finish_reason not in ABORT_REASON.values()
    if n > 1 and end.state != State.ERRORED:  # (an errored request has no per-choice reasons)
        assert end.finish_reasons is not None and len(end.finish_reasons) == n
