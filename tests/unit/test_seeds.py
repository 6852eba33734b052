"""``LASTEVENT_REDIS_URL``: one node, or a cluster's seed list; and the bound on a silent
node (``service/store/pool.py``)."""

from __future__ import annotations

from urllib.parse import urlsplit

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import RedisCluster

from service.store.pool import _silence, connect, seeds

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
        _silence(0.0, 1.0)
