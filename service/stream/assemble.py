"""One request's output assembly: token ids in, log events out.

A worker calls ``step(new_ids)`` once per engine step and ``flush()`` when the
engine finished; both return the deltas to append (at most one). Deltas are produced
only when there is text to release; the ids consumed meanwhile ride along with the
next one. The assembler *decides* (``stopped``: a stop string completed, abort the
engine); the caller acts. How the choice ends is ``endings.py``'s to say, from what
the assembler tells (``stopped``, ``has_calls``, ``completion_tokens``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from tokenizers import Tokenizer

from service.stream.detokenize import Detokenizer
from service.stream.events import Delta, Event
from service.stream.holdback import Holdback
from service.stream.logprobs import Logprob, Sampled, TokenText
from service.stream.tools import ToolFragment, ToolParser


class ResumeMismatch(ValueError):
    """A log's token ids do not decode to its text: it cannot be continued exactly."""


@dataclasses.dataclass(slots=True)
class StepResult:
    events: list[Event]
    # a stop string completed, or the tool calls asked for are complete: the choice is
    # over, abort the engine
    stopped: bool


@dataclasses.dataclass(slots=True)
class _Output:
    """What a choice showed: its content and its calls (id, name, arguments)."""

    content: list[str] = dataclasses.field(default_factory=list)
    calls: dict[int, list[str | None]] = dataclasses.field(default_factory=dict)

    def add(self, text: str, pieces: Sequence[ToolFragment]) -> None:
        self.content.append(text)
        for p in pieces:
            call = self.calls.setdefault(p.call, [p.id, p.name, ""])
            call[2] = (call[2] or "") + p.arguments

    def rest_after(self, shown: _Output) -> tuple[str, list[ToolFragment]] | None:
        """What this output has beyond ``shown`` (None: ``shown`` is not a prefix of it)."""
        mine, theirs = "".join(self.content), "".join(shown.content)
        if not mine.startswith(theirs):
            return None
        pieces = []
        for k, (cid, name, args) in sorted(self.calls.items()):
            old = shown.calls.get(k)
            if old is None:
                pieces.append(ToolFragment(k, cid, name, args or ""))
                continue
            if old[:2] != [cid, name] or not (args or "").startswith(old[2] or ""):
                return None
            if len(args or "") > len(old[2] or ""):
                pieces.append(ToolFragment(k, arguments=(args or "")[len(old[2] or "") :]))
        if set(shown.calls) - set(self.calls):
            return None
        return mine[len(theirs) :], pieces


class Assembler:
    """One choice: ids (and their logprobs) in, deltas and the end out.

    ``tools``: the choice's tool-call parser, fed what the holdback releases (content
    and call pieces come out); ``token_text``: turns the engine's logprobs into the
    log's (given when the request asked for logprobs); ``index``: the choice."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        prompt_tokens: int,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        tools: ToolParser | None = None,
        token_text: TokenText | None = None,
        index: int = 0,
    ) -> None:
        self._detok = Detokenizer(tokenizer)
        self._holdback = Holdback(stop)
        self._stop_ids = frozenset(stop_token_ids)
        self._tools = tools
        self._token_text = token_text
        self._index = index
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        self._unsent_ids: list[int] = []
        self._unsent_logprobs: list[Logprob] = []
        self._ids: list[int] = []
        self._shown = 0  # characters of content released
        self._texts = False  # fed text, not ids (``step_text``): deltas say their tokens
        self._delta_n = 0  # ``n`` of the last delta
        self._done = False  # the tool calls asked for are complete

    @classmethod
    def resume(
        cls,
        tokenizer: Tokenizer,
        logged: Sequence[Delta],
        *,
        prompt_tokens: int,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        tools: ToolParser | None = None,
        token_text: TokenText | None = None,
        index: int = 0,
    ) -> tuple[Assembler, StepResult]:
        """The assembler as it was after ``logged`` (a log's deltas of this choice, in
        order), and what it releases at once (nothing, unless the log was written by
        other rules); ``stopped`` when the logged ids already complete a stop string or
        the calls asked for. Raises ``ResumeMismatch`` if the logged ids do not make the
        logged output (another tokenizer, another parser)."""
        asm = cls(
            tokenizer,
            prompt_tokens=prompt_tokens,
            stop=stop,
            stop_token_ids=stop_token_ids,
            tools=tools,
            token_text=token_text,
            index=index,
        )
        shown = _Output()
        for d in logged:
            shown.add(d.text, d.tools or ())
        # the same pipeline over all the logged ids at once (each stage is monotone: any
        # split of its input gives the same output), then what it shows beyond the log
        made = asm._detok.step(t for d in logged for t in d.token_ids if t not in asm._stop_ids)
        asm._ids = [t for d in logged for t in d.token_ids]
        asm.completion_tokens = len(asm._ids)
        released, stopped = asm._holdback.feed(made) if made else ("", False)
        text, pieces = asm._parse(released, stopped)
        fresh = _Output()
        fresh.add(text, pieces)
        rest = fresh.rest_after(shown)
        if rest is None:
            raise ResumeMismatch(
                f"the log's {asm.completion_tokens} token ids make output that does not "
                "start with the log's"
            )
        asm._shown = len("".join(shown.content))
        return asm, StepResult(asm._delta(*rest), stopped or asm._done)

    @property
    def token_ids(self) -> Sequence[int]:
        """Every completion id consumed so far (what a continuation prefills after the
        prompt)."""
        return self._ids

    @property
    def stopped(self) -> bool:
        """A stop string completed, or the tool calls asked for are complete: the choice
        is over (its text ends before the stop string)."""
        return self._holdback.stopped or self._done

    @property
    def has_calls(self) -> bool:
        """The choice made tool calls (a choice that stops with calls: "tool_calls")."""
        return self._tools is not None and bool(self._tools.calls)

    def step(
        self, token_ids: Sequence[int], logprobs: Sequence[Sampled] | None = None
    ) -> StepResult:
        if self.stopped:
            # Tokens the engine made after the stop decision: counted, never shown.
            self.completion_tokens += len(token_ids)
            return StepResult([], True)
        self.completion_tokens += len(token_ids)
        self._unsent_ids.extend(token_ids)
        self._ids.extend(token_ids)
        if logprobs is not None and self._token_text is not None:
            kept = [(t, lp) for t, lp in zip(token_ids, logprobs, strict=True)]
            kept = [(t, lp) for t, lp in kept if t not in self._stop_ids]
            self._unsent_logprobs.extend(
                self._token_text.logprobs([t for t, _ in kept], [lp for _, lp in kept])
            )
        text = self._detok.step(t for t in token_ids if t not in self._stop_ids)
        released, stopped = self._holdback.feed(text) if text else ("", False)
        content, pieces = self._parse(released, stopped)
        return StepResult(self._delta(content, pieces), stopped or self._done)

    def step_text(self, text: str, tokens: int) -> StepResult:
        """A step of an engine that streams text, not ids (a text-mode upstream): the text
        goes straight to the holdback; ``tokens``: what the step counts for."""
        self._texts = True
        self.completion_tokens += tokens
        if self.stopped:
            return StepResult([], True)
        released, stopped = self._holdback.feed(text) if text else ("", False)
        content, pieces = self._parse(released, stopped)
        return StepResult(self._delta(content, pieces), stopped or self._done)

    def flush(self) -> list[Event]:
        """The engine finished: release what was held back (the text can no longer
        become a stop string), unless a stop string ended the choice -- or completes now,
        with the detokenizer's last characters (then ``stopped``)."""
        if self.stopped:
            return []
        tail = self._detok.finish()
        released, stopped = self._holdback.feed(tail) if tail else ("", False)
        if not stopped:
            released += self._holdback.finish()
        return self._delta(*self._parse(released, True))

    def _parse(self, released: str, last: bool) -> tuple[str, list[ToolFragment]]:
        """Released text as content and call pieces (``last``: nothing follows it)."""
        if self._tools is None:
            return released, []
        out = self._tools.feed(released) if released else []
        if last:
            out += self._tools.finish()
        self._done = self._tools.done
        content = "".join(p for p in out if isinstance(p, str))
        return content, [p for p in out if not isinstance(p, str)]

    def _delta(self, text: str, pieces: Sequence[ToolFragment] = ()) -> list[Event]:
        if not text and not pieces:
            return []
        ids, self._unsent_ids = self._unsent_ids, []
        logprobs = None
        if self._token_text is not None:
            logprobs, self._unsent_logprobs = self._unsent_logprobs, []
        # text completions' logprobs count characters from the choice's start
        offset = self._shown if logprobs is not None else None
        self._shown += len(text)
        tokens = self.completion_tokens - self._delta_n if self._texts else None
        self._delta_n = self.completion_tokens
        return [
            Delta(
                text=text,
                token_ids=ids,
                n=self.completion_tokens,
                index=self._index,
                logprobs=logprobs,
                offset=offset,
                tools=list(pieces) or None,
                tokens=tokens,
            )
        ]
