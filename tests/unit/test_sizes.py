"""The size bounds' pure parts: the CPU engine's grammar LRU (``workers/engines/grammar.py``)
and the shape checks of ids and names (``service/stream/limits.py``)."""

from __future__ import annotations

import re
import string

from hypothesis import given
from hypothesis import strategies as st

from service.stream import limits
from workers.engines.grammar import Lru

ops = st.lists(
    st.tuples(st.booleans(), st.integers(0, 30), st.integers(0, 120)), min_size=1, max_size=200
)


@given(ops, st.integers(0, 8), st.integers(0, 200))
def test_the_grammar_cache_stays_within_its_bounds(
    steps: list[tuple[bool, int, int]], max_entries: int, max_bytes: int
) -> None:
    """Whatever is put and got: at most ``max_entries`` grammars and ``max_bytes`` of
    them; the last one put is kept when it fits alone; the least recently used goes."""
    lru = Lru(max_entries, max_bytes)
    model: dict[str, int] = {}  # what an unbounded cache would hold, in use order
    for put, key, size in steps:
        name = f"schema-{key}"
        if put:
            lru.put(name, (name, size), size)
            model.pop(name, None)
            if size <= max_bytes and max_entries > 0:
                model[name] = size
        elif lru.get(name) is not None:
            model[name] = model.pop(name)
        while len(model) > max_entries or sum(model.values()) > max_bytes:
            model.pop(next(iter(model)))
        assert len(lru) <= max_entries and lru.bytes <= max_bytes
        assert lru.bytes == sum(model.values())
        assert {k for k in model if lru.get(k) is not None} == set(model)
    # (the gets above refreshed everything in ``model``'s order: nothing else is held)
    assert len(lru) == len(model)


def test_the_least_recently_used_grammar_goes_first() -> None:
    lru = Lru(max_entries=2, max_bytes=1000)
    lru.put("a", "A", 1)
    lru.put("b", "B", 1)
    assert lru.get("a") == "A"  # a is now the most recent
    lru.put("c", "C", 1)
    assert (lru.get("a"), lru.get("b"), lru.get("c")) == ("A", None, "C")
    lru.put("huge", "H", 1001)  # larger than the whole cache: not kept, nothing dropped
    assert lru.get("huge") is None and len(lru) == 2


@given(st.text(max_size=300))
def test_call_ids_are_printable_ascii_without_spaces(value: str) -> None:
    expected = 1 <= len(value) <= limits.MAX_CALL_ID_CHARS and all("!" <= c <= "~" for c in value)
    assert limits.call_id_ok(value) == expected


ID_CHARS = string.ascii_letters + string.digits + "_-"


@given(st.text(alphabet=st.sampled_from(ID_CHARS + " .!é\n\x00"), max_size=140))
def test_item_ids_are_openai_shaped(value: str) -> None:
    expected = 1 <= len(value) <= 128 and all(c in ID_CHARS for c in value)
    assert limits.item_id_ok(value) == expected
    assert limits.item_id_ok(value) == (re.fullmatch(limits.ITEM_ID, value) is not None)


@given(st.one_of(st.text(max_size=80), st.integers(), st.none()))
def test_function_names(value: object) -> None:
    expected = isinstance(value, str) and 1 <= len(value) <= 64
    expected = expected and all(c in ID_CHARS + "." for c in str(value))
    assert limits.function_name_ok(value) == expected
