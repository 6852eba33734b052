"""``ModelInfo.encode``: a long text is encoded with the GIL let go (tokenizers'
``encode_batch``), a short one holding it (``encode``); both give the same ids."""

from __future__ import annotations

import threading
import time

from hypothesis import given, settings
from hypothesis import strategies as st

from service.tokenize import GIL_HELD_CHARS, ModelInfo

WORDS = st.sampled_from(["hello", " world", "é", "\n", "<|im_start|>", "  ", "日本", "🙂", "1234"])


@settings(max_examples=60, deadline=None)
@given(head=st.lists(WORDS, max_size=40), pad=st.integers(-3, 3), special=st.booleans())
def test_a_text_gets_the_same_ids_on_either_side_of_the_threshold(
    model: ModelInfo, head: list[str], pad: int, special: bool
) -> None:
    text = "".join(head)
    long = (text + "x" * GIL_HELD_CHARS)[: GIL_HELD_CHARS + pad] + text
    for t in (text, long):
        want = model.tokenizer.encode(t, add_special_tokens=special).ids
        assert model.encode(t, add_special_tokens=special) == want


def test_another_thread_runs_while_a_long_text_is_encoded(model: ModelInfo) -> None:
    """A thread that ticks every millisecond ticks on while a long text is encoded: with
    tokenizers' ``encode``, which holds the GIL, it could tick once or twice at most (when
    the encode has returned, before the caller looks)."""
    text = "hello world " * 200_000  # 2.4 MB: the tokenizer takes most of a second
    ticks, stop = [0], threading.Event()

    def tick() -> None:
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        before = ticks[0]
        ids = model.encode(text)
        during = ticks[0] - before
    finally:
        stop.set()
        ticker.join()
    assert len(ids) > 100_000
    assert during >= 20, f"the other thread ticked {during} times while the text was encoded"
