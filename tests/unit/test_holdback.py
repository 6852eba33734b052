"""Multi-stop holdback: property tests against a brute-force reference."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from service.stream.holdback import Holdback

ALPHABET = "ab#E\n"


def reference_cut(text: str, stops: list[str]) -> tuple[str, bool]:
    """Scan end positions: the first stop string to complete wins (longest on a tie)."""
    for end in range(1, len(text) + 1):
        done = [s for s in stops if text[:end].endswith(s)]
        if done:
            return text[: end - max(len(s) for s in done)], True
    return text, False


def longest_stop_prefix_suffix(pending: str, stops: list[str]) -> int:
    best = 0
    for s in stops:
        for k in range(1, min(len(s) - 1, len(pending)) + 1):
            if pending.endswith(s[:k]):
                best = max(best, k)
    return best


def chunked(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet=ALPHABET, max_size=40),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), min_size=0, max_size=3),
    cuts=st.lists(st.integers(min_value=0, max_value=60), max_size=12),
)
def test_released_text_equals_reference_whatever_the_chunking(
    text: str, stops: list[str], cuts: list[int]
) -> None:
    expected, expect_stop = reference_cut(text, stops)
    hb = Holdback(stops)
    out = ""
    fed = ""
    for chunk in chunked(text, cuts):
        fed += chunk
        released, stopped = hb.feed(chunk)
        out += released
        # nothing released can later turn out to be (part of) a stop string
        assert expected.startswith(out)
        if stopped:
            break
        # released at once: only the longest suffix that can still become a stop is held
        k = longest_stop_prefix_suffix(fed, stops)
        assert hb.pending == (fed[-k:] if k else "")
        assert out + hb.pending == fed
    out += hb.finish()
    assert out == expected
    assert hb.stopped == expect_stop


def test_two_stop_strings_at_once() -> None:
    hb = Holdback(["###END", "\n\n"])
    assert hb.feed("Café costs 5€.\n") == ("Café costs 5€.", False)
    assert hb.pending == "\n"
    assert hb.feed("#") == ("\n", False)  # "\n#" can no longer become "\n\n" or "###END"
    assert hb.feed("##E") == ("", False)
    assert hb.feed("ND more") == ("", True)
    assert hb.matched == "###END"


def test_stop_is_excluded_and_later_text_ignored() -> None:
    hb = Holdback(["STOP"])
    assert hb.feed("abcSTOPdef") == ("abc", True)
    assert hb.feed("more") == ("", True)
    assert hb.finish() == ""


def test_empty_stop_rejected() -> None:
    with pytest.raises(ValueError):
        Holdback([""])
