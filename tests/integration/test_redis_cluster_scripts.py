"""ops/redis-cluster's scripts against nine real Redis servers: three primaries with two
replicas each, made by create.sh; a primary lost for good, its promoted replica still
confirming (WAIT 1) to the other; the lost node replaced by an empty one and the dead one
forgotten; then every node moved to a new address at once and found again by start.sh.

The nodes are named as in a deployment (n1 ... n9, each with its own address on the
loopback range), so the scripts resolve names: each command runs in a mount namespace of
its own whose /etc/hosts is the test's. Needs root (unshare, mount), redis-server and
redis-cli (Debian's redis-server package); skipped without them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "ops" / "redis-cluster"
NODES = 9
SHARDS = [[1, 4, 7], [2, 5, 8], [3, 6, 9]]  # the first of each its primary at creation
PORT = 7300  # node i listens on PORT + i (its bus on + 10000)
NODE_TIMEOUT_MS = 2000  # (redis.conf's 5000, shortened for the test)


def _can_run() -> str | None:
    for tool in ("redis-server", "redis-cli", "unshare", "getent"):
        if shutil.which(tool) is None:
            return f"no {tool}"
    if os.geteuid() != 0:
        return "needs root (a mount namespace for /etc/hosts)"
    try:
        subprocess.run(
            ["unshare", "-m", "sh", "-c", "mount --bind /etc/hosts /etc/hosts"],
            check=True,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return "cannot make a mount namespace here"
    return None


_WHY_NOT = _can_run()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=_WHY_NOT or "")


class Cluster:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.ops = tmp / "ops"
        shutil.copytree(OPS, self.ops)
        conf = self.ops / "redis.conf"
        conf.write_text(conf.read_text().replace("\ndir /data\n", f"\ndir {tmp}\n"))
        self.hosts = tmp / "hosts"
        self.base = 0
        self.move(40)

    def move(self, base: int) -> None:
        """Node i's address is 127.0.77.(base + i) from now on (its name stays)."""
        self.base = base
        lines = [Path("/etc/hosts").read_text().rstrip("\n")]
        lines += [f"{self.ip(i)} n{i}" for i in range(1, NODES + 1)]
        self.hosts.write_text("\n".join(lines) + "\n")

    def ip(self, i: int) -> str:
        return f"127.0.77.{self.base + i}"

    def name(self, i: int) -> str:
        return f"n{i}:{PORT + i}"

    def run(self, *cmd: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        """``cmd`` where the nodes' names resolve (a mount namespace with our hosts)."""
        return subprocess.run(
            [
                *("unshare", "-m", "sh", "-c", 'mount --bind "$0" /etc/hosts && exec "$@"'),
                str(self.hosts),
                *cmd,
            ],
            env={**os.environ, **(env or {})},
            capture_output=True,
            text=True,
            timeout=240,
        )

    def data(self, i: int) -> Path:
        return self.tmp / f"node{i}"

    def start(self, i: int) -> None:
        self.data(i).mkdir(exist_ok=True)
        out = self.run(
            "sh",
            str(self.ops / "start.sh"),
            "--cluster-announce-hostname",
            f"n{i}",
            # on a shared loopback, each node's own address (in a container it is the only one)
            "--bind",
            self.ip(i),
            "--cluster-announce-ip",
            self.ip(i),
            "--port",
            str(PORT + i),
            "--dir",
            str(self.data(i)),
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            "--daemonize",
            "yes",
            "--pidfile",
            str(self.data(i) / "pid"),
            "--logfile",
            str(self.data(i) / "log"),
            env={"REDIS_ENTRYPOINT": "env", "REDIS_DATA_DIR": str(self.data(i))},
        )
        assert out.returncode == 0, out.stdout + out.stderr
        self.client(i).ping()  # (retried by the client until it answers)

    def stop(self, i: int) -> None:
        pid = self.data(i) / "pid"
        if pid.exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid.read_text()), 9)
            pid.unlink()

    def create(self) -> str:
        shards = "; ".join(" ".join(self.name(i) for i in shard) for shard in SHARDS)
        out = self.run(
            "sh",
            str(self.ops / "create.sh"),
            env={"REDIS_CLUSTER_SHARDS": shards, "REDIS_CLUSTER_WAIT_S": "10"},
        )
        assert out.returncode == 0, out.stdout + out.stderr
        assert "create.sh: ready" in out.stderr
        return out.stderr

    def client(self, i: int) -> redis.Redis:
        return redis.Redis(
            host=self.ip(i),
            port=PORT + i,
            decode_responses=True,
            socket_timeout=5,
            retry_on_error=[redis.ConnectionError],
            retry=redis.retry.Retry(redis.backoff.ConstantBackoff(0.1), 50),
        )

    def nodes(self, i: int) -> dict[str, tuple[str, str, str, int]]:
        """Node i's view: name -> (id, flags, its primary's id, slot ranges)."""
        view = {}
        for line in str(self.client(i).execute_command("CLUSTER", "NODES")).splitlines():
            node_id, addr, flags, primary, *rest = line.split()
            name = addr.partition(",")[2]
            view[name] = (node_id, flags, primary, len(rest) - 4)
        return view


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        for i in range(1, NODES + 1):
            c.stop(i)


def wait_for(what: str, check: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not callable(check) or not check():
        assert time.monotonic() < deadline, f"not within {timeout_s} s: {what}"
        time.sleep(0.2)


def as_planned(c: Cluster, *, seen_from: int) -> bool:
    """Each shard, as node ``seen_from`` sees it: one primary serving slots, its two
    other nodes its replicas."""
    view = c.nodes(seen_from)
    for shard in SHARDS:
        names = [f"n{i}" for i in shard]
        if not set(names) <= set(view):
            return False  # (not heard of yet)
        primaries = [n for n in names if "master" in view[n][1] and view[n][3] > 0]
        if len(primaries) != 1:
            return False
        primary_id = view[primaries[0]][0]
        followers = [n for n in names if view[n][2] == primary_id and "fail" not in view[n][1]]
        if len(followers) != 2:
            return False
    return True


def test_create_failover_replace_move(cluster: Cluster) -> None:
    c = cluster
    for i in range(1, NODES + 1):
        c.start(i)
    log = c.create()
    assert "creating the cluster" in log
    wait_for(
        "two replicas per primary", lambda: c.client(1).info("replication")["connected_slaves"] == 2
    )
    wait_for("the shards as planned", lambda: as_planned(c, seen_from=2))
    # again: nothing to do
    log = c.create()
    assert "creating" not in log and "joins" not in log

    # n1, the first shard's primary, is lost for good: n4 or n7 takes over and still has
    # a replica, so a write is confirmed (WAIT 1) as at `replica`
    c.stop(1)

    def promoted() -> int | None:
        view = c.nodes(2)
        return next((i for i in (4, 7) if "master" in view[f"n{i}"][1]), None)

    wait_for("a replica of n1 promoted", lambda: promoted() is not None)
    new = promoted()
    assert new is not None
    primary = c.client(new)
    wait_for("the promoted node serves", lambda: primary.cluster("info")["cluster_state"] == "ok")
    key = next(k for k in (f"k{n}" for n in range(100)) if primary.cluster("keyslot", k) < 5461)
    pipe = primary.pipeline(transaction=False)
    pipe.set(key, "v")
    pipe.execute_command("WAIT", 1, 2000)
    assert pipe.execute()[1] == 1, "no replica acknowledged on the promoted node"

    # n1 replaced by an empty node: create.sh makes it a replica of its shard's primary
    # and forgets the dead one everywhere
    dead_id = c.nodes(2)["n1"][0]
    shutil.rmtree(c.data(1))
    c.start(1)
    log = c.create()
    assert "n1:7301 joins as a replica" in log and f"forgetting {dead_id}" in log
    wait_for("n1 a replica again", lambda: primary.info("replication")["connected_slaves"] == 2)
    for i in range(1, NODES + 1):
        wait_for(
            f"n{i} knows nine nodes, none failed, not the dead one",
            lambda i=i: (
                len(view := c.nodes(i)) == NODES
                and not any("fail" in f for _, f, _, _ in view.values())
                and dead_id not in {v[0] for v in view.values()}
            ),
        )
    wait_for("the shards as planned", lambda: as_planned(c, seen_from=3))

    # every node moves at once (a `docker compose down` and `up`, every pod rescheduled):
    # start.sh finds its peers by name
    for i in range(1, NODES + 1):
        c.stop(i)
    c.move(60)
    for i in range(1, NODES + 1):
        c.start(i)
    c.create()
    for i in range(1, NODES + 1):
        wait_for(
            f"n{i} in a cluster that is up",
            lambda i=i: c.client(i).cluster("info")["cluster_state"] == "ok",
        )
    wait_for("the shards as planned", lambda: as_planned(c, seen_from=5))
