"""A reader's continuity check (``events.Progress``): every log an assembler writes
follows on, delta after delta, in any split and over several choices; a log with a delta
missing or sent twice (entries a failover took back, a continuation spliced after a
shortened log) is caught at that delta."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from service.stream.assemble import Assembler
from service.stream.events import Created, Delta, Event, Progress
from service.tokenize import ModelInfo
from tests.unit.conftest import VOCAB_SIZE
from tests.unit.test_assemble import PROPS, split

ids = st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=1, max_size=40)


def log_of(model: ModelInfo, choices: list[list[int]], cuts: list[int]) -> list[Event]:
    """A log as a worker writes it: ``created``, then each choice's deltas interleaved."""
    per_choice = []
    for index, made in enumerate(choices):
        asm = Assembler(model.tokenizer, prompt_tokens=1, index=index)
        deltas = [e for step in split(made, cuts) for e in asm.step(step).events]
        per_choice.append(deltas + asm.flush())
    out: list[Event] = [Created(kind="chat", model="m", created=0, prompt_tokens=1, n=len(choices))]
    while any(per_choice):
        for deltas in per_choice:
            if deltas:
                out.append(deltas.pop(0))
    return out


@PROPS
@given(choices=st.lists(ids, min_size=1, max_size=3), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_a_log_as_written_follows_on(
    tiny_model: ModelInfo, choices: list[list[int]], cuts: list[int]
) -> None:
    progress = Progress()
    assert all(progress.follows(e) for e in log_of(tiny_model, choices, cuts))


@PROPS
@given(made=ids, cuts=st.lists(st.integers(0, 60), max_size=8), at=st.integers(0, 100))
def test_a_delta_missing_or_twice_is_caught(
    tiny_model: ModelInfo, made: list[int], cuts: list[int], at: int
) -> None:
    log = log_of(tiny_model, [made], cuts)
    deltas = [i for i, e in enumerate(log) if isinstance(e, Delta) and e.token_ids]
    if len(deltas) < 2:
        return
    i = deltas[at % (len(deltas) - 1)]  # (not the last: a gap needs a delta after it)
    for broken in (log[:i] + log[i + 1 :], log[: i + 1] + log[i:]):
        progress = Progress()
        assert not all(progress.follows(e) for e in broken)
