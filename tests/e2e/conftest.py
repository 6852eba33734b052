"""Real processes: the API and workers run as subprocesses against real Redis/Postgres."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
import redis
from redis.cluster import ClusterNode

from service.settings import MODEL_NAME, Settings
from service.store.pool import seeds
from tests.conftest import CLUSTER

NODE = os.environ.get("LASTEVENT_TEST_NODE") == "1"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass
class Stack:
    settings: Settings
    logs: Path
    procs: list[subprocess.Popen[bytes]] = dataclasses.field(default_factory=list)
    api_urls: list[str] = dataclasses.field(default_factory=list)
    api_procs: dict[str, subprocess.Popen[bytes]] = dataclasses.field(default_factory=dict)

    @property
    def url(self) -> str:
        return self.api_urls[0]

    @property
    def model(self) -> str:
        return MODEL_NAME

    def _spawn(self, role: str, name: str, **overrides: object) -> subprocess.Popen[bytes]:
        env = {**os.environ, **self.settings.to_env()}
        env.update({f"LASTEVENT_{k.upper()}": str(v) for k, v in overrides.items()})
        with open(self.logs / f"{name}.log", "wb") as out:  # (the child keeps its own copy)
            proc = subprocess.Popen(
                [sys.executable, "-m", "service.cli", role],
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs.append(proc)
        return proc

    def start_api(self, port: int | None = None, **overrides: object) -> str:
        port = port or free_port()
        proc = self._spawn("api", f"api-{port}", port=port, **overrides)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"API exited: {self.tail(f'api-{port}')}")
            try:
                if httpx.get(url + "/readyz", timeout=1).status_code == 200:
                    self.api_urls.append(url)
                    self.api_procs[url] = proc
                    return url
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"API did not become ready: {self.tail(f'api-{port}')}")

    def start_worker(
        self, name: str = "worker", *, wait: bool = True, **overrides: object
    ) -> subprocess.Popen[bytes]:
        proc = self._spawn("worker", name, worker_id=f"{name}-{uuid.uuid4().hex[:6]}", **overrides)
        deadline = time.monotonic() + 240
        while wait and "ready (engine" not in self.tail(name, 1_000_000):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"worker did not start: {self.tail(name)}")
            time.sleep(0.1)
        return proc

    def start_node(self, name: str = "node", **overrides: object) -> subprocess.Popen[bytes]:
        """``lastevent node``: an API and a worker in one process, its URL in ``api_urls``."""
        port = free_port()
        worker_id = f"{name}-{uuid.uuid4().hex[:6]}"
        proc = self._spawn("node", name, port=port, worker_id=worker_id, **overrides)
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 240
        while "ready (engine" not in self.tail(name, 1_000_000) or not _ready(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"node did not start: {self.tail(name)}")
            time.sleep(0.1)
        self.api_urls.append(url)
        self.api_procs[url] = proc
        return proc

    def store(self) -> redis.Redis:
        """A client of the stack's Redis (of its cluster, when it runs on one)."""
        url = self.settings.redis_url or ""
        if self.settings.redis_cluster:  # (a seed list: any node that answers)
            nodes = [urlsplit(u) for u in seeds(url)]
            return redis.RedisCluster(  # type: ignore[return-value]
                startup_nodes=[ClusterNode(u.hostname or "", u.port or 6379) for u in nodes]
            )
        return redis.Redis.from_url(url)

    def tail(self, name: str, n: int = 3000) -> str:
        path = self.logs / f"{name}.log"
        return path.read_text(errors="replace")[-n:] if path.exists() else ""

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _ready(url: str) -> bool:
    try:
        return httpx.get(url + "/readyz", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def make_stack(
    tmp: Path, redis_url: str, database_url: str, model_dir: Path, **settings: object
) -> Stack:
    values: dict[str, object] = {
        "redis_url": redis_url,
        "database_url": database_url,
        "data_dir": tmp,
        "model_dir": model_dir,
        "key_prefix": f"e{uuid.uuid4().hex[:10]}",
        "engine": "scripted",
        "scripted_tokens_per_s": 200.0,
        "keepalive_s": 1.0,
        "auth": "off",  # API keys and tenants are tested in test_auth.py
        # every test client is 127.0.0.1: failed keys are throttled in test_auth.py only
        "auth_failures_per_minute": 0,
        # byte-for-byte comparisons between live streams and replays must not depend on
        # how loaded the machine is (coalescing is tested in tests/unit/test_coalesce.py)
        "coalesce_backlog": 1_000_000,
        "metrics_port": 0,  # several workers on one machine; tests that scrape pass a port
    }
    # the shared Redis of the main tier has no AOF: readers get what it answered; the
    # cluster tier's has a replica per primary: what a replica received
    values["durability"] = "memory"
    if CLUSTER:
        values.update(redis_cluster=True, partitions=6, durability="replica")
    values.update(settings)
    s = Settings(**values)  # type: ignore[arg-type]
    logs = tmp / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    return Stack(settings=s, logs=logs)


@contextlib.contextmanager
def running(
    tmp: Path,
    redis_url: str,
    database_url: str,
    model_dir: Path,
    *,
    apis: int = 1,
    **settings: object,
) -> Iterator[Stack]:
    """A stack with one worker and ``apis`` API processes, stopped on exit. Under
    ``LASTEVENT_TEST_NODE=1`` (``make test-node``) the worker and the first API process
    are one node (``lastevent node``, its log ``worker.log``): the e2e core run against it,
    with the other API processes as the replicas that read the log in Redis."""
    st = make_stack(tmp, redis_url, database_url, model_dir, **settings)
    try:
        if NODE:
            st.start_node("worker")
        else:
            st.start_worker()
        for _ in range(apis - 1 if NODE else apis):
            st.start_api()
        yield st
    finally:
        st.stop()


@pytest.fixture(scope="module")
def stack(
    tmp_path_factory: pytest.TempPathFactory, redis_url: str, database_url: str, model_dir: Path
) -> Iterator[Stack]:
    with running(tmp_path_factory.mktemp("stack"), redis_url, database_url, model_dir) as st:
        yield st
