"""A group read that ran late is merged with the consumer's own pending entries
(``groups.merged``): every entry once, the pending ones first, per stream."""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from service.store.groups import merged

ids = st.integers(0, 30).map(lambda n: f"{n}-0".encode())
reply = st.lists(
    st.tuples(
        st.sampled_from([b"a", b"b", b"c"]),
        st.lists(ids, unique=True, max_size=6).map(lambda xs: [(x, {b"n": x}) for x in xs]),
    ),
    max_size=3,
    unique_by=lambda r: r[0],
)


@given(reply, reply)
def test_every_entry_once_the_first_reply_first(
    first: list[tuple[Any, list[tuple[Any, Any]]]], then: list[tuple[Any, list[tuple[Any, Any]]]]
) -> None:
    out = dict(merged(first, then))
    for stream in {s for s, _ in [*first, *then]}:
        a = [e for s, es in first if s == stream for e in es]
        b = [e for s, es in then if s == stream for e in es]
        got = out.get(stream, [])
        assert [i for i, _ in got] == [i for i, _ in a] + [
            i for i, _ in b if i not in {j for j, _ in a}
        ]
    assert all(entries for _, entries in merged(first, then))  # no empty stream


def test_a_stream_only_the_late_read_has_is_kept() -> None:
    assert merged([], [(b"q", [(b"1-0", {})])]) == [(b"q", [(b"1-0", {})])]
    assert merged([(b"q", [])], []) == []
