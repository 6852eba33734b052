"""Text mode's side of ``upstream_wire`` (no I/O): the body a text-only server is sent
and how its chat or completion chunks become steps -- any split of the text, the finish
and the usage (a chunk of its own, after the finish) making the last step."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from service.stream.lifecycle import EngineFinish
from service.stream.params import SamplingParams, Structured
from workers.engines.base import EngineError
from workers.engines.upstream_wire import TextReader, text_body

CONV = msgspec.json.encode({"messages": [{"role": "user", "content": "hi"}]})


def chat_chunk(text: str | None, reason: str | None = None) -> dict[str, object]:
    delta = {} if text is None else {"content": text}
    return {
        "object": "chat.completion.chunk",
        "choices": [{"delta": delta, "finish_reason": reason}],
    }


@given(
    pieces=st.lists(st.text(max_size=8), max_size=12),
    reason=st.sampled_from(["stop", "length", "content_filter"]),
    usage=st.none() | st.integers(0, 10_000),
    completion=st.booleans(),
)
def test_any_split_of_the_text_comes_back_whole_then_one_last_step(
    pieces: list[str], reason: str, usage: int | None, completion: bool
) -> None:
    reader = TextReader()
    steps = []
    for i, piece in enumerate(pieces):
        if completion:  # /v1/completions' chunks carry ``text``
            chunk: dict[str, object] = {"choices": [{"text": piece, "finish_reason": None}]}
        else:
            chunk = chat_chunk(piece if i % 3 else (piece or None))
        steps += reader.feed(chunk)
    steps += reader.feed(chat_chunk(None, reason))
    assert reader.end() and not [s for s in steps if s.finished]  # (end() is idempotent)
    if usage is not None:
        steps += reader.feed({"choices": [], "usage": {"completion_tokens": usage}})
    steps += reader.end()
    assert "".join(s.text or "" for s in steps) == "".join(pieces)
    last = steps[-1]
    assert last.finished and last.token_ids == [] and last.completion_tokens == usage
    want = {"stop": EngineFinish.STOP, "length": EngineFinish.LENGTH}.get(reason, EngineFinish.STOP)
    assert last.finish_reason == want
    assert all(not s.finished for s in steps[:-1])


def test_a_stream_that_ends_without_a_finish_ends_nothing() -> None:
    reader = TextReader()
    assert [s.text for s in reader.feed(chat_chunk("half"))] == ["half"]
    assert reader.end() == []  # (the engine calls it cut, and tries again or fails)


def test_an_error_in_the_stream_raises() -> None:
    with pytest.raises(EngineError) as caught:
        TextReader().feed({"error": {"message": "overloaded"}})
    assert caught.value.code == "upstream_error"


def test_the_body_of_a_chat_and_of_a_prompt() -> None:
    params = SamplingParams(
        max_tokens=50,
        temperature=0.0,
        seed=7,
        stop=("a", "b", "c", "d", "e"),
        presence_penalty=0.5,
        structured=Structured(kind="json_schema", schema='{"type": "object"}'),
    )
    path, body = text_body("m", CONV, params, 40)
    assert path == "/chat/completions"
    assert body["messages"] == [{"role": "user", "content": "hi"}]
    assert body["max_tokens"] == 40 and body["seed"] == 7 and body["presence_penalty"] == 0.5
    assert body["stop"] == ["a", "b", "c", "d"]  # OpenAI takes four: the holdback has all
    assert body["response_format"]["json_schema"]["schema"] == {"type": "object"}
    assert body["stream_options"] == {"include_usage": True}
    assert "frequency_penalty" not in body and "logit_bias" not in body
    path, body = text_body("m", json.dumps({"prompt": "once"}).encode(), params, 40)
    assert path == "/completions" and body["prompt"] == "once"


def test_a_job_without_a_conversation_is_an_error_not_a_guess() -> None:
    with pytest.raises(EngineError):
        text_body("m", b"", SamplingParams(max_tokens=5), 5)
