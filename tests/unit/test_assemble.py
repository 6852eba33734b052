"""Detokenizer + holdback over the real SmolLM2 tokenizer, any split into engine steps."""

from __future__ import annotations

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from service.stream.assemble import Assembler
from service.stream.events import Delta, End
from service.stream.lifecycle import State
from service.tokenize import ModelInfo
from tests.unit.test_holdback import reference_cut

SPICE = ["é", "€", "日本語", "🤖", "👩‍👩‍👧", " ", "\n", "##", "END", "Ã", "ß", "\u0301", "ab"]
texts = st.lists(st.one_of(st.sampled_from(SPICE), st.text(max_size=6)), max_size=14).map("".join)
PROPS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


def split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in zip(points, points[1:], strict=False)]


def run(model: ModelInfo, ids: list[int], stops: list[str], cuts: list[int]) -> tuple[str, End]:
    asm = Assembler(model.tokenizer, prompt_tokens=1, stop=stops, stop_token_ids=model.eos_token_ids)
    out = []
    for step in split(ids, cuts):
        res = asm.step(step)
        out += [e.text for e in res.events if isinstance(e, Delta)]
        if res.stopped:
            break
    events = asm.finish(State.FINISHED, "length")
    out += [e.text for e in events if isinstance(e, Delta)]
    end = events[-1]
    assert isinstance(end, End)
    return "".join(out), end


@PROPS
@given(text=texts, stop_picks=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 4)), max_size=3),
       cuts=st.lists(st.integers(0, 200), max_size=20))
def test_deltas_equal_full_decode_cut_at_first_stop(
    model: ModelInfo, text: str, stop_picks: list[tuple[int, int]], cuts: list[int]
) -> None:
    ids = model.encode(text)
    full = model.decode(ids)
    # stop strings taken from the text itself, so they really occur (sometimes mid-character)
    stops = [full[a % max(1, len(full)) :][:n] for a, n in stop_picks]
    stops = [s for s in stops if s]
    got, end = run(model, ids, stops, cuts)
    expected, stopped = reference_cut(full, stops)
    assert got == expected
    assert ("\ufffd" in got) <= ("\ufffd" in full)
    assert end.finish_reason == ("stop" if stopped else "length")
    assert end.completion_tokens >= 1 or not ids


@PROPS
@given(ids=st.lists(st.integers(0, 49151), max_size=30), cuts=st.lists(st.integers(0, 60), max_size=10))
def test_arbitrary_token_ids_stream_like_a_full_decode(
    model: ModelInfo, ids: list[int], cuts: list[int]
) -> None:
    """Byte fragments that never complete a character still end up as the full decode does."""
    assume(not set(ids) & set(model.eos_token_ids))
    got, end = run(model, ids, [], cuts)
    assert got == model.decode(ids)
    assert end.completion_tokens == len(ids)


def test_eos_is_counted_not_shown(model: ModelInfo) -> None:
    ids = model.encode("Hi there") + list(model.eos_token_ids)
    got, end = run(model, ids, [], [])
    assert got == "Hi there"
    assert end.completion_tokens == len(ids)


def test_model_info_from_a_plain_hugging_face_directory(model_dir, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """GPU users point LASTEVENT_MODEL_DIR at any HF directory; no lastevent.json needed."""
    import shutil

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        shutil.copy(model_dir / name, tmp_path / name)
    plain = ModelInfo.load(tmp_path)
    prepared = ModelInfo.load(model_dir)
    assert plain.eos_token_ids == prepared.eos_token_ids
    assert plain.chat_template == prepared.chat_template
    assert plain.max_model_len == prepared.max_model_len
    messages = [{"role": "user", "content": "hi"}]
    assert plain.render_chat(messages) == prepared.render_chat(messages)
