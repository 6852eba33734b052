"""One request's output assembly: token ids in, log events out.

A worker calls ``step(new_ids)`` once per engine step and ``finish(...)`` when
the engine is done; both return the events to append (at most a ``Delta`` and,
at the end, the terminal ``End``). Deltas are produced only when there is text
to release; the ids consumed meanwhile ride along with the next one. The
assembler *decides* (``stopped``: a stop string completed, abort the engine);
the caller acts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tokenizers import Tokenizer

from service.stream.detokenize import Detokenizer
from service.stream.events import Delta, End, Error, Event
from service.stream.holdback import Holdback
from service.stream.lifecycle import FinishReason, State


class ResumeMismatch(ValueError):
    """A log's token ids do not decode to its text: it cannot be continued exactly."""


@dataclasses.dataclass(slots=True)
class StepResult:
    events: list[Event]
    stopped: bool  # a stop string completed: the request is over, abort the engine


class Assembler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        prompt_tokens: int,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> None:
        self._detok = Detokenizer(tokenizer)
        self._holdback = Holdback(stop)
        self._stop_ids = frozenset(stop_token_ids)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self._unsent_ids: list[int] = []
        self._ids: list[int] = []
        self.ended = False

    @classmethod
    def resume(
        cls,
        tokenizer: Tokenizer,
        logged: Sequence[Delta],
        *,
        prompt_tokens: int,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
    ) -> tuple[Assembler, StepResult]:
        """The assembler as it was after ``logged`` (a log's deltas, in order), and what it
        releases at once (nothing, unless the log was written by other rules); ``stopped``
        when the logged ids already complete a stop string. Raises ``ResumeMismatch`` if
        the logged ids do not decode to the logged text (another tokenizer)."""
        asm = cls(tokenizer, prompt_tokens=prompt_tokens, stop=stop, stop_token_ids=stop_token_ids)
        shown = "".join(d.text for d in logged)
        made = "".join(
            asm._detok.step(t for t in d.token_ids if t not in asm._stop_ids) for d in logged
        )
        asm._ids = [t for d in logged for t in d.token_ids]
        asm.completion_tokens = len(asm._ids)
        if not made.startswith(shown):
            raise ResumeMismatch(
                f"the log's {asm.completion_tokens} token ids decode to text that does not "
                "start with the log's text"
            )
        held = made[len(shown) :]
        released, stopped = asm._holdback.feed(held) if held else ("", False)
        return asm, StepResult(asm._delta(released), stopped)

    @property
    def token_ids(self) -> Sequence[int]:
        """Every completion id consumed so far (what a continuation prefills after the
        prompt)."""
        return self._ids

    def step(self, token_ids: Sequence[int]) -> StepResult:
        if self.ended or self._holdback.stopped:
            # Tokens the engine made after the stop decision: counted, never shown.
            self.completion_tokens += len(token_ids)
            return StepResult([], True)
        self.completion_tokens += len(token_ids)
        self._unsent_ids.extend(token_ids)
        self._ids.extend(token_ids)
        text = self._detok.step(t for t in token_ids if t not in self._stop_ids)
        released, stopped = self._holdback.feed(text) if text else ("", False)
        events: list[Event] = []
        if released or stopped:
            events.extend(self._delta(released))
        return StepResult(events, stopped)

    def finish(self, state: State, finish_reason: str | None) -> list[Event]:
        """Flush held text (unless a stop string ended it) and close with ``End``."""
        events: list[Event] = []
        if self._holdback.stopped:
            state, finish_reason = State.FINISHED, FinishReason.STOP
        elif state == State.FINISHED:
            tail = self._detok.finish()
            released, stopped = self._holdback.feed(tail) if tail else ("", False)
            if stopped:
                finish_reason = FinishReason.STOP
            else:
                released += self._holdback.finish()
            events.extend(self._delta(released))
        events.append(self._end(state, finish_reason))
        return events

    def fail(self, code: str, message: str) -> list[Event]:
        """The engine failed: an in-band error, then ``End(errored)``."""
        return [Error(code=code, message=message), self._end(State.ERRORED, None)]

    def _delta(self, text: str) -> list[Event]:
        if not text:
            return []
        ids, self._unsent_ids = self._unsent_ids, []
        return [Delta(text=text, token_ids=ids, n=self.completion_tokens)]

    def _end(self, state: State, finish_reason: str | None) -> End:
        self.ended = True
        return End(
            state=str(state),
            finish_reason=None if finish_reason is None else str(finish_reason),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
        )
