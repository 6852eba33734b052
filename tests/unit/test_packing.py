"""Our Redis connections pack commands with hiredis: the same bytes as redis-py's own
packer for every argument type we send, and the same refusal of the rest."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Connection
from redis.exceptions import DataError

from service.store.pool import _Connection

ARG = st.one_of(
    st.text(),
    st.binary(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
)


def _bytes(chunks: list[bytes] | list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(c) for c in chunks)


@given(
    st.sampled_from(["EVALSHA", "XADD", "CONFIG GET", b"CLIENT LIST", "hset"]),
    st.lists(ARG, max_size=50),
)
def test_hiredis_packs_as_redis_py_does(
    name: str | bytes, args: list[str | bytes | int | float]
) -> None:
    ours, theirs = _Connection(), Connection()
    assert _bytes(ours.pack_command(name, *args)) == _bytes(theirs.pack_command(name, *args))
    commands = [(name, *args), ("PING",)]
    assert _bytes(ours.pack_commands(commands)) == _bytes(theirs.pack_commands(commands))


@pytest.mark.parametrize("bad", [True, None, object()])
def test_what_redis_py_refuses_is_still_refused(bad: object) -> None:
    with pytest.raises(DataError):
        _Connection().pack_command("SET", "k", bad)  # type: ignore[arg-type]
