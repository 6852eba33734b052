"""A Redis Cluster primary killed mid-stream (``kill -9``) and its replica promoted --
at once (``CLUSTER FAILOVER TAKEOVER``, what an operator or an orchestrator does) or by
the cluster's own election (after ``cluster-node-timeout``) -- under concurrent streaming
clients that resume (``tests/chaos/conftest.py``'s harness), at each durability level.

Replication is asynchronous: the replica may not have the primary's last writes. At
``replica`` readers were sent only what a replica acknowledged, so the promoted one has
every event any client saw: each client's text and ids are its log's, whatever the
replica lacked (a worker's append that finds the log shorter than what it wrote ends the
request errored ``log_lost`` in band). At ``memory`` and ``disk`` (what the primary
answered or fsynced: neither is on the replica yet) a failover may take back events a
client saw; the request then ends ``log_lost`` in band after a prefix of them, never with
another continuation spliced in. The test prints what was lost (``-s``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from service.store.keys import Keys
from tests.chaos.conftest import (
    Fault,
    drive,
    false_takeovers,
    logs_of,
    pause_s,
    server_errors,
    utc_now,
    verdicts,
)
from tests.chaos.test_stack_outages import billing_findings, client_findings, request_findings
from tests.cluster import LocalCluster, Node
from tests.e2e.conftest import make_stack

pytestmark = [pytest.mark.chaos, pytest.mark.timeout(300)]


@dataclasses.dataclass
class Failover:
    cluster: LocalCluster
    behind_s: float  # how far behind its primary the replica is when the primary dies
    election: bool  # the cluster elects the replica (else it takes over at once)
    victim: Node  # the primary killed
    killed_port: int = 0
    promoted_port: int = 0

    def fault(self) -> Fault:
        victim = self.victim
        replica = self.cluster.replicas_of(victim)[0]

        def begin() -> None:
            self.killed_port = victim.port
            if self.behind_s:  # the link to the replica is down for a while
                replica.pause()  # (so that it does not connect again at once)
                victim.client().client_kill_filter(_type="replica")
                pause_s(self.behind_s)
            victim.kill()
            if self.behind_s:
                replica.resume()
            if not self.election:
                replica.client().execute_command("CLUSTER", "FAILOVER", "TAKEOVER")

        def end() -> None:
            self.promoted_port = self.cluster.wait_failover(victim).port
            victim.start()  # it comes back as a replica of the promoted one

        how = "elected" if self.election else "taking over"
        return Fault(f"kill -9 of a primary; its replica {how}", begin, end, 0.0)


@dataclasses.dataclass(frozen=True)
class Case:
    level: str  # LASTEVENT_DURABILITY
    behind_s: float = 0.0
    election: bool = False


CASES = [
    pytest.param(Case("replica"), id="replica-in-sync"),
    pytest.param(Case("replica", behind_s=1.0), id="replica-1s-behind"),
    pytest.param(Case("replica", election=True), id="replica-elected"),
    pytest.param(Case("disk"), id="disk-in-sync"),
    pytest.param(Case("disk", election=True), id="disk-elected"),
    pytest.param(Case("memory"), id="memory-in-sync"),
    pytest.param(Case("memory", election=True), id="memory-elected"),
    pytest.param(Case("memory", behind_s=1.0), id="memory-1s-behind"),
]


@pytest.mark.parametrize("case", CASES)
def test_a_primary_killed_mid_stream_fails_over_to_its_replica(
    tmp_path: Path,
    database_url: str,
    model_dir: Path,
    capsys: pytest.CaptureFixture[str],
    case: Case,
) -> None:
    """kill -9 of a primary under 18 streams (6 more sent during and after), its replica
    in sync or one second behind (its link cut, and the replica stopped so that it does
    not connect again, for the second before the kill). Every request ends; a client
    sees its whole answer, or (a log that lost its tail) the in-band ``log_lost`` -- at
    ``replica`` after exactly what its log holds, at the other levels after a prefix of
    what it saw; nothing but 503s; one billing row each, and reconcile is clean."""
    appendfsync = "always" if case.level == "disk" else "everysec"
    cluster = LocalCluster(
        tmp_path / "cluster", node_timeout_ms=2000, appendfsync=appendfsync
    ).start()
    partitions = 6
    stack = make_stack(
        tmp_path / "stack",
        cluster.url,
        database_url,
        model_dir,
        redis_cluster=True,
        partitions=partitions,
        scripted_tokens_per_s=40.0,
        worker_concurrency=16,
        durability=case.level,
    )
    try:
        for i in range(2):
            stack.start_worker(f"worker-{i + 1}")
        for _ in range(2):
            stack.start_api()
        keys = Keys(stack.settings.key_prefix, partitions)
        # the primary that holds the heartbeats (and the workers' named connections), so
        # that a failover is also one of the node the sweepers watch
        victim = cluster.primary_of(keys.workers)
        on_victim = {p for p in keys.all_partitions if cluster.primary_of(keys.queue(p)) is victim}
        assert on_victim, "the killed primary serves no partition: the test tests nothing"
        failover = Failover(cluster, case.behind_s, case.election, victim)
        since = utc_now(-1)
        outcome = asyncio.run(drive(stack.api_urls, failover.fault(), early=18, during=3, after=3))
        rids = [c.rid for c in outcome.accepted if c.rid is not None]
        found = asyncio.run(verdicts(stack.api_urls, rids))

        findings = client_findings(outcome)
        hit = lost = lost_entries = 0
        committed = case.level == "replica"
        for c in outcome.accepted:
            v = found[c.rid or ""]
            findings += request_findings(c, v, lost_ok=True, committed=committed)
            if keys.partition(c.rid or "") in on_victim:
                hit += 1
            if v.log_error == "log_lost":
                lost += 1
            lost_entries += len(set(c.ids) - set(v.log_ids))
        findings += billing_findings(stack, database_url, rids, since)
        findings += server_errors(stack) + false_takeovers(stack)
        assert not findings, "\n".join(findings) + "\n\n" + logs_of(stack)
        assert len(rids) == 24, [c.gave_up for c in outcome.clients]
        with capsys.disabled():
            print(
                f"\nfailover ({case}): {len(rids)} requests, {hit} in the "
                f"{len(on_victim)} partitions of the killed primary "
                f"(:{failover.killed_port} -> :{failover.promoted_port}); "
                f"failover took {outcome.back_at - outcome.fault_at:.1f} s; "
                f"{lost} ended errored log_lost; {lost_entries} events a client had seen "
                "were not in the log after"
            )
    finally:
        stack.stop()
        cluster.stop()
