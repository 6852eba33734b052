"""The assembler fed text instead of ids (an upstream in text mode), any split of the
text into chunks: the deltas are the text cut at the first stop string, as for ids; each
delta says the tokens it stands for, so a reader's gap check (``Progress``) follows every
one of them -- with the engine's own count replacing the chunk count at the end too."""

from __future__ import annotations

import itertools

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from service.stream.assemble import Assembler
from service.stream.events import Created, Delta, Kind, Progress
from service.tokenize import ModelInfo
from tests.unit.test_assemble import texts
from tests.unit.test_holdback import reference_cut

PROPS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


def chunks_of(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


@PROPS
@given(
    text=texts,
    stop_picks=st.lists(st.tuples(st.integers(0, 50), st.integers(1, 4)), max_size=3),
    cuts=st.lists(st.integers(0, 200), max_size=20),
    engine_count=st.none() | st.integers(0, 400),
)
def test_text_chunks_cut_at_the_first_stop_and_follow_on(
    tiny_model: ModelInfo,
    text: str,
    stop_picks: list[tuple[int, int]],
    cuts: list[int],
    engine_count: int | None,
) -> None:
    stops = [s for s in (text[a % max(1, len(text)) :][:n] for a, n in stop_picks) if s]
    asm = Assembler(tiny_model.tokenizer, prompt_tokens=1, stop=stops)
    deltas: list[Delta] = []
    for chunk in chunks_of(text, cuts):
        res = asm.step_text(chunk, 1)
        deltas += [e for e in res.events if isinstance(e, Delta)]
        if res.stopped:
            break
    if engine_count is not None:  # the engine's own count, said at the end
        asm.completion_tokens = engine_count
    deltas += [e for e in asm.flush() if isinstance(e, Delta)]
    expected, _ = reference_cut(text, stops)
    assert "".join(d.text for d in deltas) == expected
    progress = Progress()
    progress.follows(Created(kind=Kind.CHAT, model="m", created=0, prompt_tokens=1))
    assert all(progress.follows(d) for d in deltas)
    assert all(d.token_ids == [] and d.tokens is not None for d in deltas)
