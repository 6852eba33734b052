"""The worker's decisions, without I/O: what a presence verdict asks for, and -- one
engine step at a time -- what a choice's generation does next.

The generation loop (``generate.py``) feeds every engine output, with the request's
control signals, into ``ChoiceRun.step`` and applies the ``Action`` that comes back:
append these deltas, abort the engine, the choice is over (how: ``endings.py``). This
is vLLM's habit (its output processor returns ``reqs_to_abort``; its caller aborts),
and it is why the real per-step decision is unit-tested without an engine
(``tests/unit/test_decide.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence

from service.stream import endings
from service.stream.assemble import Assembler, StepResult
from service.stream.endings import ChoiceEnd, Failure, HandOver, Recovery, Shown, Stopped
from service.stream.events import Delta, Event
from service.stream.lifecycle import VERDICT_STATE, EngineFinish, State, Verdict
from workers.engines.base import StepOutput


@dataclasses.dataclass(frozen=True, slots=True)
class Abort:
    """Stop the engine now; the request ends in ``state``."""

    state: State


@dataclasses.dataclass(frozen=True, slots=True)
class RecheckIn:
    """No reader now: ask again when the grace period runs out."""

    seconds: float


def plan(verdict: int) -> Abort | RecheckIn | None:
    """What ``owner_verdicts.lua``'s answer for one running request asks of its owner."""
    if verdict in VERDICT_STATE:
        return Abort(VERDICT_STATE[Verdict(verdict)])
    if verdict < 0:
        return RecheckIn(-verdict / 1000)
    return None


@dataclasses.dataclass(slots=True)
class Signals:
    """A running request's control signals: set by the runner (which aborts the engine
    at once), read by each of its choices at every step."""

    decided: State | None = None  # cancelled / abandoned
    handing_over: bool = False  # the worker is stopping: another worker continues it


@dataclasses.dataclass(frozen=True, slots=True)
class Action:
    """What to do after a step: append ``append`` (deltas), then abort the engine request
    if ``abort``; ``stop``: the choice is over, and how (None: go on)."""

    append: list[Event] = dataclasses.field(default_factory=list)
    abort: bool = False
    stop: Stopped | None = None


class ChoiceRun:
    """One choice's generation, decided step by step. ``stop_ids``: the ids that end the
    choice (EOS unless ``ignore_eos``, and the request's stop ids)."""

    def __init__(
        self, asm: Assembler, index: int, *, stop_ids: Collection[int], ignore_eos: bool
    ) -> None:
        self.asm = asm
        self.index = index
        self._stop_ids = stop_ids
        self._ignore_eos = ignore_eos
        self._covered: int | None = None  # tokens made before an abort decision
        self._after = 0  # tokens the engine made after it (counted, never shown)
        self._logged = asm.completion_tokens  # tokens carried by deltas for the log

    @property
    def completion_tokens(self) -> int:
        return self.asm.completion_tokens + self._after

    def resumed(self, now: StepResult) -> Action:
        """A choice continued from its log (``Assembler.resume``'s result): what the log's
        ids release at once; over already if they end the choice (the previous worker
        logged its last token, not its end)."""
        made = self.asm.token_ids
        last_is_stop = bool(made) and made[-1] in self._stop_ids and not self._ignore_eos
        self._note(now.events)
        if now.stopped or last_is_stop:
            return Action(now.events, stop=self._finished(EngineFinish.STOP))
        return Action(now.events)

    def step(self, out: StepOutput, signals: Signals) -> Action:
        if signals.handing_over and signals.decided is None:
            return Action(stop=HandOver())
        if signals.decided is not None:  # decided: count what the engine still makes
            if self._covered is None:
                self._covered = self.asm.completion_tokens
            self._after += len(out.token_ids)
            return Action(stop=self._aborted(signals.decided) if out.finished else None)
        if out.text is not None:  # (an engine that streams text)
            step = self.asm.step_text(out.text, int(bool(out.text)))
        else:
            step = self.asm.step(out.token_ids, out.logprobs)
        if out.completion_tokens is not None:  # the engine's own count, at the end
            self.asm.completion_tokens = out.completion_tokens
        self._note(step.events)
        if step.stopped:  # a stop string completed: free the engine now
            return Action(step.events, abort=True, stop=self._finished(None))
        if not out.finished:
            return Action(step.events)
        if out.finish_reason == EngineFinish.ABORT:  # the engine aborted on its own
            return Action(step.events, stop=self.failed(endings.ENGINE_ABORTED).stop)
        return Action(step.events, stop=self._finished(out.finish_reason))

    def exhausted(self, signals: Signals) -> Action:
        """The engine's outputs ended without a finished one."""
        if signals.decided is not None:
            return Action(stop=self._aborted(signals.decided))
        if signals.handing_over:
            return Action(stop=HandOver())
        return Action(stop=self._finished(None))

    def failed(self, failure: Failure, *, abort: bool = False) -> Action:
        """The engine failed, or the deadline passed (``abort``: the engine still runs it)."""
        end = endings.failed_choice(self.index, failure, self.completion_tokens, self._logged)
        return Action(abort=abort, stop=end)

    def fenced(self) -> Action:
        """Another worker took the request over: stop, end nothing."""
        return Action(abort=True, stop=endings.FENCED_OUT)

    def _note(self, events: Sequence[Event]) -> None:
        self._logged += sum(e.consumed for e in events if isinstance(e, Delta))

    def _shown(self) -> Shown:
        asm = self.asm
        return Shown(self.index, asm.stopped, asm.has_calls, self.completion_tokens, self._logged)

    def _finished(self, engine: EngineFinish | None) -> ChoiceEnd:
        tail = self.asm.flush()  # (first: the held text may complete a stop string)
        return endings.finished(self._shown(), engine, tail=tail, covered_tokens=self._covered)

    def _aborted(self, decided: State) -> ChoiceEnd:
        covered = self.asm.completion_tokens if self._covered is None else self._covered
        return endings.aborted(self._shown(), decided, covered)


def how_claimed(first_run: bool, logged: Sequence[Delta], recovery: Recovery) -> str:
    """How a worker came to run a request (one of ``events.CLAIMS``): the recovery counts
    past what the logged deltas' marks already account for."""
    if first_run and not logged:
        return "first"
    marks = [d.how for d in logged if d.by is not None]
    for how, count in (
        ("takeover", recovery.takeovers),
        ("handover", recovery.handovers),
        ("resumed", recovery.parks),
    ):
        if count > marks.count(how):
            return how
    return "continued"
