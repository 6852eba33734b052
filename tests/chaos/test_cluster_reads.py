"""Stream reads on a Redis Cluster are routed by their own keys: ``XREAD`` and
``XREADGROUP`` ask no node for their keys (redis-py's parser sent ``COMMAND GETKEYS`` to
one node per read), and when that node is lost for good, reads of the slots the other
nodes serve go on. Before ``pool._Cluster``, every read of a client whose reads all went
to other nodes failed at the dead node for ever -- an API process's tail shards, all its
streams hung after a failover. A local cluster of the test's own; its node killed
(``kill -9``), never restarted, its replica promoted at once."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from service.store import groups, pool
from service.store.commit import Committer, Durability, Uncommitted
from service.store.keys import Keys
from tests.cluster import LocalCluster, Node
from tests.waiting import eventually

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(120)]

SAFETY_S = 30.0  # a wait this long means the client never followed: the finding
PARTITIONS = 12


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    yield from _cluster(tmp_path, replicas_each=1)


@pytest.fixture
def nine(tmp_path: Path) -> Iterator[LocalCluster]:
    """Three primaries with two replicas each: one still follows the new primary."""
    yield from _cluster(tmp_path, replicas_each=2)


def _cluster(tmp_path: Path, replicas_each: int) -> Iterator[LocalCluster]:
    local = LocalCluster(
        tmp_path / "cluster", node_timeout_ms=1000, replicas_each=replicas_each
    ).start()
    try:
        yield local
    finally:
        local.stop()


def getkeys_calls(cluster: LocalCluster) -> int:
    """``COMMAND GETKEYS`` calls the live nodes served."""
    total = 0
    for node in cluster.live():
        stats = node.client().info("commandstats")
        total += int(stats.get("cmdstat_command|getkeys", {}).get("calls", 0))
    return total


async def reads_work(client: Redis, keys: list[str]) -> bool:
    """One ``XREAD`` and one ``XREADGROUP`` of each key answered (an error is a no)."""
    try:
        for key in keys:
            await client.xread({key: "0-0"}, count=1)
            await groups.read(client, [key], "g", "c", pending=True, count=1, block_ms=1)
    except pool.STORE_ERRORS:
        return False
    return True


def test_stream_reads_ask_no_node_for_their_keys_and_outlive_it(cluster: LocalCluster) -> None:
    async def scenario() -> None:
        client = pool.connect(cluster.seeds, 8, cluster=True)
        try:
            await pool.warm(client)
            asked: Node = next(
                n
                for n in cluster.nodes
                if n.port == client.commands_parser.node.port  # type: ignore[attr-defined]
            )
            # the slots other nodes serve: nothing this client sends goes to ``asked``
            keys = [
                k
                for k in (f"{{p{i}.0}}:wake" for i in range(PARTITIONS))
                if cluster.primary_of(k) is not asked
            ]
            assert keys, "every partition on one node: the test tests nothing"
            for key in keys:
                await client.xadd(key, {"n": "1"})
                await groups.ensure(client, key, "g")
            before = getkeys_calls(cluster)
            assert await reads_work(client, keys)
            assert getkeys_calls(cluster) == before  # (was one per read)

            replica = cluster.replicas_of(asked)[0]
            asked.kill()  # for good
            with contextlib.suppress(Exception):
                replica.client().execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
            await eventually(
                lambda: reads_work(client, keys),
                "reads of the slots the live nodes serve",
                timeout=SAFETY_S,
                interval=0.2,
            )
        finally:
            await client.aclose()

    asyncio.run(scenario())


def test_a_read_through_a_stale_slot_map_is_not_confirmed(nine: LocalCluster) -> None:
    """A process reads through one cluster client (the tailer's) and confirms through
    another (the commit barrier's): each has its own slot map. After a failover the
    reader's may still name the old primary -- one frozen and woken answers as a primary
    until it learns it was replaced, and what it holds then is taken back -- while the
    barrier goes to the new one. A mark taken through the reader's map is not confirmed
    by the new primary's barrier; one taken through the barrier's own map is."""
    local = nine

    async def scenario() -> None:
        keys = Keys("t", 6)
        reader = pool.connect(local.seeds, 8, cluster=True)
        barriers = pool.connect(local.seeds, 8, cluster=True)
        try:
            await pool.warm(reader)
            await pool.warm(barriers)
            committer = Committer(barriers, keys, Durability.REPLICA)
            await committer.check()
            victim = local.primary_of(keys.commit(0))
            stale = committer.mark(0, reader)
            assert stale == committer.mark(0)  # one map, one node, before the failover
            replicas = local.replicas_of(victim)
            victim.kill()
            replicas[0].client().execute_command("CLUSTER", "FAILOVER", "TAKEOVER")

            async def barriers_learnt() -> bool:
                await pool.relearn(barriers, keys.commit(0), 5.0)
                return committer.mark(0) not in (stale, "?")

            await eventually(
                barriers_learnt,
                "the barriers' client learns the new primary",
                timeout=SAFETY_S,
                interval=0.2,
            )
            assert committer.mark(0, reader) == stale  # the reader has not looked since
            with pytest.raises(Uncommitted):
                await committer.confirm(0, stale, reader)

            async def confirmed() -> bool:  # (once the other replica follows the new primary)
                try:
                    await committer.confirm(0, committer.mark(0))
                except Uncommitted:
                    return False
                return True

            await eventually(
                confirmed, "a barrier on the new primary", timeout=SAFETY_S, interval=0.2
            )
        finally:
            await reader.aclose()
            await barriers.aclose()

    asyncio.run(scenario())


def test_the_replica_check_follows_a_failover_its_client_did_not_see(nine: LocalCluster) -> None:
    """At ``replica`` a process checks that every primary has a connected replica (at its
    start, and on ``/readyz``). A slot map learnt before a failover still names the old
    primary -- a replica now, with no replica of its own -- when nothing the process sent
    failed there: the check learns the map again before it says a primary is alone (an
    API process restarted in the soak refused to start for it)."""
    local = nine

    async def scenario() -> None:
        client = pool.connect(local.seeds, 8, cluster=True)
        try:
            await pool.warm(client)
            committer = Committer(client, Keys("t", 6), Durability.REPLICA)
            await committer.check()
            old = local.primaries[0]
            new = local.replicas_of(old)[0]
            new.client().execute_command("CLUSTER", "FAILOVER")  # (graceful: nobody lost)
            await eventually(
                lambda: old.role() == "slave",
                "the old primary demoted",
                timeout=SAFETY_S,
                interval=0.2,
            )
            assert any(n.port == old.port for n in client.get_primaries())  # type: ignore[attr-defined]
            await committer.check()  # (was: NoReplica naming the old primary)
        finally:
            await client.aclose()

    asyncio.run(scenario())
