"""Detokenizer + holdback over a byte-level BPE tokenizer, any split into engine steps.

The tokenizer (``tiny_model``, tests/unit/conftest.py) is trained in memory on multi-byte
UTF-8, so many tokens are fragments of a character; no torch, no packaged model.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from service.stream import endings
from service.stream.assemble import Assembler
from service.stream.events import Delta, End, Event
from service.stream.lifecycle import EngineFinish
from service.tokenize import ModelInfo, ModelMeta
from tests.unit.conftest import EOS_TOKEN, VOCAB_SIZE
from tests.unit.test_holdback import reference_cut

SPICE = ["é", "€", "日本語", "🤖", "👩‍👩‍👧", " ", "\n", "##", "END", "Ã", "ß", "\u0301", "ab"]
texts = st.lists(st.one_of(st.sampled_from(SPICE), st.text(max_size=6)), max_size=14).map("".join)
PROPS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def split(ids: list[int], cuts: list[int]) -> list[list[int]]:
    points = sorted({c % (len(ids) + 1) for c in cuts} | {0, len(ids)})
    return [ids[a:b] for a, b in itertools.pairwise(points)]


def finish(asm: Assembler, engine: EngineFinish) -> list[Event]:
    """The engine finished the choice: the held text, then the choice's ``End`` (as the
    worker ends it: ``endings.finished``, then the request's ending of that one choice)."""
    tail = asm.flush()
    shown = endings.Shown(0, asm.stopped, asm.has_calls, asm.completion_tokens)
    choice = endings.finished(shown, engine, tail=tail)
    request = endings.Request("chatcmpl-test", None, asm.prompt_tokens, 0)
    ending = endings.ran(request, [choice])
    assert isinstance(ending, endings.Ending)
    return list(ending.events)


def run(model: ModelInfo, ids: list[int], stops: list[str], cuts: list[int]) -> tuple[str, End]:
    asm = Assembler(
        model.tokenizer, prompt_tokens=1, stop=stops, stop_token_ids=model.eos_token_ids
    )
    out = []
    for step in split(ids, cuts):
        res = asm.step(step)
        out += [e.text for e in res.events if isinstance(e, Delta)]
        if res.stopped:
            break
    events = finish(asm, EngineFinish.LENGTH)
    out += [e.text for e in events if isinstance(e, Delta)]
    end = events[-1]
    assert isinstance(end, End)
    return "".join(out), end


def test_the_tokenizer_splits_characters(tiny_model: ModelInfo) -> None:
    """What makes the properties below worth having: tokens that are not whole characters."""
    ids = tiny_model.encode("".join(SPICE))
    alone = [tiny_model.decode([i]) for i in ids]
    assert any("\ufffd" in text for text in alone)
    assert tiny_model.decode(ids) == "".join(SPICE)


@PROPS
@given(
    text=texts,
    stop_picks=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 4)), max_size=3),
    cuts=st.lists(st.integers(0, 200), max_size=20),
)
def test_deltas_equal_full_decode_cut_at_first_stop(
    tiny_model: ModelInfo, text: str, stop_picks: list[tuple[int, int]], cuts: list[int]
) -> None:
    ids = tiny_model.encode(text)
    full = tiny_model.decode(ids)
    # stop strings taken from the text itself, so they really occur (sometimes mid-character)
    stops = [full[a % max(1, len(full)) :][:n] for a, n in stop_picks]
    stops = [s for s in stops if s]
    got, end = run(tiny_model, ids, stops, cuts)
    expected, stopped = reference_cut(full, stops)
    assert got == expected
    assert ("\ufffd" in got) <= ("\ufffd" in full)
    assert end.finish_reason == ("stop" if stopped else "length")
    assert end.completion_tokens >= 1 or not ids


@PROPS
@given(
    ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=30),
    cuts=st.lists(st.integers(0, 60), max_size=10),
)
def test_arbitrary_token_ids_stream_like_a_full_decode(
    tiny_model: ModelInfo, ids: list[int], cuts: list[int]
) -> None:
    """Byte fragments that never complete a character still end up as the full decode does."""
    assume(not set(ids) & set(tiny_model.eos_token_ids))
    got, end = run(tiny_model, ids, [], cuts)
    assert got == tiny_model.decode(ids)
    assert end.completion_tokens == len(ids)


def test_eos_is_counted_not_shown(tiny_model: ModelInfo) -> None:
    ids = tiny_model.encode("Hi there") + list(tiny_model.eos_token_ids)
    got, end = run(tiny_model, ids, [], [])
    assert got == "Hi there"
    assert end.completion_tokens == len(ids)


def test_model_info_from_a_plain_hugging_face_directory(
    tiny_model: ModelInfo, tmp_path: Path
) -> None:
    """GPU users point LASTEVENT_MODEL_DIR at any HF directory; no lastevent.json needed."""
    eos = tiny_model.eos_token_ids[0]
    plain_dir, prepared_dir = tmp_path / "plain", tmp_path / "prepared"
    for d in (plain_dir, prepared_dir):
        d.mkdir()
        tiny_model.tokenizer.save(str(d / "tokenizer.json"))
    # what a Hugging Face model directory holds (the EOS id in generation_config.json)
    (plain_dir / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": tiny_model.chat_template, "eos_token": EOS_TOKEN})
    )
    (plain_dir / "config.json").write_text(
        json.dumps({"max_position_embeddings": tiny_model.max_model_len, "eos_token_id": 0})
    )
    (plain_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    # what `lastevent model prepare` writes
    ModelMeta(
        model_name="prepared",
        eos_token_ids=(eos,),
        bos_token_id=None,
        chat_template=tiny_model.chat_template,
        max_model_len=tiny_model.max_model_len,
    ).write(prepared_dir)

    plain = ModelInfo.load(plain_dir)
    prepared = ModelInfo.load(prepared_dir)
    assert plain.eos_token_ids == prepared.eos_token_ids == (eos,)
    assert plain.chat_template == prepared.chat_template
    assert plain.max_model_len == prepared.max_model_len == tiny_model.max_model_len
    messages = [{"role": "user", "content": "hi"}]
    assert plain.render_chat(messages) == prepared.render_chat(messages)
    assert plain.render_chat(messages) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    text = "Café 日本語 🤖"
    assert plain.encode(text) == prepared.encode(text) == tiny_model.encode(text)

    # no generation_config.json and no eos_token_id anywhere: the eos_token's id
    (plain_dir / "generation_config.json").unlink()
    (plain_dir / "config.json").write_text(json.dumps({}))
    fallback = ModelInfo.load(plain_dir)
    assert fallback.eos_token_ids == (eos,)
    assert fallback.max_model_len == 8192
