"""A takeover continues a request from its log: ``Assembler.resume`` rebuilt from the deltas
a worker logged before it died, fed the ids the next worker makes, gives exactly what one
uninterrupted assembler gives -- the text, the stop, the token count -- wherever the cut
falls: inside a character, inside a stop string's prefix, right after the stop completed.

The dead worker's ids that never reached a logged delta are made again by the next worker
(temperature 0), so the continuation is fed every id after the last logged delta.
"""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from service.stream.assemble import Assembler, ResumeMismatch
from service.stream.events import Delta, End, Event
from service.stream.lifecycle import EngineFinish
from service.stream.logprobs import Sampled, TokenText
from service.stream.tools import ToolFormat, parser_for
from service.tokenize import ModelInfo
from tests.unit.test_assemble import PROPS, finish, run, split, texts


def _assembler(model: ModelInfo, stops: list[str]) -> Assembler:
    return Assembler(
        model.tokenizer, prompt_tokens=1, stop=stops, stop_token_ids=model.eos_token_ids
    )


def _finish(asm: Assembler, rest: list[list[int]], out: list[Event]) -> End:
    for step in rest:
        res = asm.step(step)
        out += res.events
        if res.stopped:
            break
    events = finish(asm, EngineFinish.LENGTH)
    out += events
    end = events[-1]
    assert isinstance(end, End)
    return end


@PROPS
@given(
    text=texts,
    stops=st.lists(st.sampled_from(["END", "é", "##", "日本", "ab", "\n\n", "🤖"]), max_size=2),
    cuts=st.lists(st.integers(0, 200), max_size=12),
    dies_after=st.integers(0, 30),
)
def test_a_continuation_from_the_log_equals_an_uninterrupted_run(
    tiny_model: ModelInfo, text: str, stops: list[str], cuts: list[int], dies_after: int
) -> None:
    ids = tiny_model.encode(text)
    whole_text, whole_end = run(tiny_model, ids, stops, cuts)
    steps = split(ids, cuts)
    # the first worker: runs some steps; what it logged is its deltas (the rest is lost)
    first = _assembler(tiny_model, stops)
    logged: list[Delta] = []
    for step in steps[:dies_after]:
        res = first.step(step)
        logged += [e for e in res.events if isinstance(e, Delta)]
        if res.stopped:
            break
    consumed = sum(len(d.token_ids) for d in logged)
    assert [t for d in logged for t in d.token_ids] == ids[:consumed]
    # the next worker: rebuilt from the log, fed every id after it (made again)
    asm, now = Assembler.resume(
        tiny_model.tokenizer,
        logged,
        prompt_tokens=1,
        stop=stops,
        stop_token_ids=tiny_model.eos_token_ids,
    )
    assert list(asm.token_ids) == ids[:consumed]
    out: list[Event] = list(now.events)
    end = _finish(asm, [] if now.stopped else split(ids[consumed:], cuts), out)
    shown = "".join(d.text for d in logged) + "".join(e.text for e in out if isinstance(e, Delta))
    assert shown == whole_text
    assert (end.state, end.finish_reason) == (whole_end.state, whole_end.finish_reason)
    if whole_end.finish_reason == "length":
        assert end.completion_tokens == whole_end.completion_tokens == len(ids)


def test_a_cut_inside_a_stop_prefix_still_stops(tiny_model: ModelInfo) -> None:
    """The log shows "Hello " and the worker held "EN" (maybe "END"): the next worker holds
    it again, and the "D" it makes completes the stop -- nothing of it is shown."""
    ids = tiny_model.encode("Hello ENDworld")
    asm = _assembler(tiny_model, ["END"])
    logged: list[Delta] = []
    for i in ids:
        logged += [e for e in asm.step([i]).events if isinstance(e, Delta)]
        if "".join(d.text for d in logged) == "Hello " and asm._holdback.pending:
            break
    assume_shown = "".join(d.text for d in logged)
    assert assume_shown == "Hello "
    resumed, now = Assembler.resume(tiny_model.tokenizer, logged, prompt_tokens=1, stop=["END"])
    assert now.events == [] and not now.stopped
    consumed = len(resumed.token_ids)
    out: list[Event] = []
    end = _finish(resumed, [[i] for i in ids[consumed:]], out)
    assert [e for e in out if isinstance(e, Delta)] == []
    assert end.finish_reason == "stop"


def test_a_cut_inside_a_character_completes_it(tiny_model: ModelInfo) -> None:
    """A delta's last id is the first byte of "€": the next worker's first id completes the
    character, which is the first text it shows."""
    ids = tiny_model.encode("ab€€€")
    pieces = [tiny_model.decode([i]) for i in ids]
    split_at = next(i for i, p in enumerate(pieces) if "\ufffd" in p and i > 0)
    logged_ids = ids[: split_at + 1]
    asm = _assembler(tiny_model, [])
    res = asm.step(logged_ids)
    [delta] = [e for e in res.events if isinstance(e, Delta)]
    assert delta.token_ids == logged_ids  # the half character's id is in the log
    resumed, _ = Assembler.resume(tiny_model.tokenizer, [delta], prompt_tokens=1)
    out: list[Event] = []
    _finish(resumed, [[i] for i in ids[split_at + 1 :]], out)
    rest = "".join(e.text for e in out if isinstance(e, Delta))
    assert delta.text + rest == "ab€€€"
    assert "\ufffd" not in rest


def test_a_log_from_another_tokenizer_is_refused(tiny_model: ModelInfo) -> None:
    ids = tiny_model.encode("hello")
    try:
        Assembler.resume(tiny_model.tokenizer, [Delta("goodbye", ids, len(ids))], prompt_tokens=1)
    except ResumeMismatch:
        return
    raise AssertionError("a log whose ids do not make its text was continued")


def _tool_output(pieces: list[Event]) -> tuple[str, dict[int, list[str | None]]]:
    """A choice's content and its calls (id, name, arguments), from its deltas."""
    content, calls = "", {}
    for d in pieces:
        if not isinstance(d, Delta):
            continue
        content += d.text
        for p in d.tools or ():
            call = calls.setdefault(p.call, [p.id, p.name, ""])
            call[2] = (call[2] or "") + p.arguments
    return content, calls


def _hermes(k: int) -> str:
    args = {"city": "Zürich 東京 🤖", "n": k, "tags": ["a}", '"b\\']}
    return (
        "<tool_call>\n"
        + json.dumps({"name": f"f{k}", "arguments": args}, ensure_ascii=False)
        + "\n</tool_call>"
    )


TOOL_TEXTS = st.builds(
    lambda before, calls, after: before + "".join(_hermes(k) for k in range(calls)) + after,
    st.sampled_from(["", "Sure. ", "<tool", "a < b "]),
    st.integers(0, 2),
    st.sampled_from(["", "\n", " done"]),
)


@PROPS
@given(
    text=TOOL_TEXTS,
    cuts=st.lists(st.integers(0, 200), max_size=12),
    dies_after=st.integers(0, 60),
    logprobs=st.booleans(),
)
def test_a_continuation_with_tool_calls_equals_an_uninterrupted_run(
    tiny_model: ModelInfo, text: str, cuts: list[int], dies_after: int, logprobs: bool
) -> None:
    """The cut may fall inside the held marker, inside a call's name, inside an argument
    string: the calls (ids included: they come from the request id) and the content of
    the continued choice are those of one uninterrupted assembler, and so is the count."""
    ids = tiny_model.encode(text)
    fmt = ToolFormat("hermes")
    text_of = TokenText(tiny_model.tokenizer)

    def assembler(logged: list[Delta] | None = None) -> tuple[Assembler, list[Event], bool]:
        kw: dict[str, Any] = {
            "prompt_tokens": 1,
            "stop_token_ids": tiny_model.eos_token_ids,
            "tools": parser_for(fmt, lambda k: f"call_{k}"),  # ids the request id makes
            "token_text": text_of if logprobs else None,
        }
        if logged is None:
            return Assembler(tiny_model.tokenizer, **kw), [], False
        asm, now = Assembler.resume(tiny_model.tokenizer, logged, **kw)
        return asm, list(now.events), now.stopped

    def feed(asm: Assembler, steps: list[list[int]], out: list[Event]) -> None:
        for step in steps:
            sampled = [Sampled(-0.5, ((t, -0.5),)) for t in step] if logprobs else None
            res = asm.step(step, sampled)
            out += res.events
            if res.stopped:
                return

    whole, expected, _ = assembler()
    feed(whole, split(ids, cuts), expected)
    expected += finish(whole, EngineFinish.STOP)
    first, logged_events, _ = assembler()
    feed(first, split(ids, cuts)[:dies_after], logged_events)
    logged = [e for e in logged_events if isinstance(e, Delta)]
    consumed = sum(len(d.token_ids) for d in logged)
    asm, out, stopped = assembler(logged)
    if not stopped:
        feed(asm, split(ids[consumed:], cuts), out)
    out += finish(asm, EngineFinish.STOP)
    assert _tool_output([*logged, *out]) == _tool_output(expected)
    end, whole_end = out[-1], expected[-1]
    assert isinstance(end, End) and isinstance(whole_end, End)
    assert end.finish_reason == whole_end.finish_reason
    assert end.completion_tokens == whole_end.completion_tokens
    if logprobs:  # one per id that reached a delta (the log's own are kept, not redone)
        got = [lp.token for d in [*logged, *out] if isinstance(d, Delta) for lp in d.logprobs or []]
        shown_ids = [t for d in [*logged, *out] if isinstance(d, Delta) for t in d.token_ids]
        assert got == [text_of(t)[0] for t in shown_ids]
