"""``LASTEVENT_REDIS_URL``: one node, or a cluster's seed list; and the bound on a silent
node (``service/store/pool.py``)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import RedisCluster

from service.settings import Settings
from service.store.pool import _silence, connect, seeds, stream_keys

hosts = st.from_regex(r"[a-z][a-z0-9-]{0,15}(\.[a-z][a-z0-9-]{0,10}){0,2}", fullmatch=True)
ports = st.integers(1, 65535)


@given(st.lists(st.tuples(hosts, ports), min_size=1, max_size=9), st.booleans())
def test_every_seed_keeps_its_host_and_port_and_the_first_ones_credentials(
    nodes: list[tuple[str, int]], bare: bool
) -> None:
    first = f"rediss://user:secret@{nodes[0][0]}:{nodes[0][1]}/0"
    rest = [f"{h}:{p}" if bare else f"rediss://user:secret@{h}:{p}" for h, p in nodes[1:]]
    found = [urlsplit(u) for u in seeds(" , ".join([first, *rest]) + ",")]
    assert [(u.hostname, u.port) for u in found] == nodes
    assert {(u.scheme, u.username, u.password) for u in found} == {("rediss", "user", "secret")}


def test_a_cluster_client_knows_every_seed() -> None:
    client = connect("redis://a:7000,b:7001,redis://c:7002", 4, cluster=True)
    assert isinstance(client, RedisCluster)
    names = {node.name for node in client.nodes_manager.startup_nodes.values()}
    assert names == {"a:7000", "b:7001", "c:7002"}


def test_several_urls_for_one_node_are_refused() -> None:
    with pytest.raises(ValueError, match="LASTEVENT_REDIS_CLUSTER"):
        connect("redis://a:6379,redis://b:6379", 4)
    with pytest.raises(ValueError, match="empty"):
        seeds(" , ")


def test_a_silent_node_is_given_up_past_a_commands_own_wait() -> None:
    assert _silence(2.0, 1.0) == {
        "socket_timeout": 3.0,
        "socket_connect_timeout": 2.0,
        "socket_keepalive": True,
    }
    with pytest.raises(ValueError, match="LASTEVENT_REDIS_SILENT_S"):
        Settings(redis_silent_s=0.0)  # (checked once, where settings are built)


# -- the keys of a stream read (pool.stream_keys: no COMMAND GETKEYS on a cluster) --

_names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=8)


@given(
    st.lists(_names, min_size=1, max_size=4),
    st.booleans(),
    st.sampled_from(["streams", "STREAMS", "g"]),
    st.one_of(st.none(), st.integers(1, 100)),
    st.sampled_from([str, str.encode]),
)
def test_stream_keys_are_those_after_streams(
    keys: list[str], group: bool, name: str, count: int | None, as_arg: Any
) -> None:
    ids = ["0-0"] * len(keys)
    args: list[Any] = []
    if group:
        args += ["GROUP", name, name]  # (a group or consumer may be called "streams")
    if count is not None:
        args += ["COUNT", count]
    args += ["BLOCK", 10, "STREAMS", *keys, *ids]
    command = "XREADGROUP" if group else "XREAD"
    args = [as_arg(a) if isinstance(a, str) else a for a in args]
    assert stream_keys(command, tuple(args)) == [as_arg(k) for k in keys]


def test_stream_keys_of_other_commands_and_malformed_reads_are_left_to_redis_py() -> None:
    assert stream_keys("GET", ("k",)) is None
    assert stream_keys("XREAD", ("COUNT", 1)) is None  # no STREAMS
    assert stream_keys("XREAD", ("STREAMS", "a", "b", "0")) is None  # odd: keys and ids differ
    assert stream_keys("xread", ("streams", "a", "0")) == ["a"]
