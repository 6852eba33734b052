"""Redis clients whose pools wait for a free connection instead of failing.

redis-py's default asyncio pool raises ``MaxConnectionsError`` the moment every
connection is busy. Under a burst (a worker claiming 64 jobs at once, 500 clients
connecting to one API process) that turned into failed requests. A blocking pool
queues the caller until a connection is free, for at most ``wait_s``.

Each new connection also looked up redis-py's version in the installed package
metadata (a file read, in the event loop) for ``CLIENT SETINFO``: half the cost of
opening a connection, paid 256 times in a burst of new streams. It is read once here.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from importlib.metadata import version
from typing import Any, cast
from urllib.parse import urlsplit

import hiredis
from redis.asyncio import BlockingConnectionPool, Connection, Redis, RedisCluster
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import (
    ClusterDownError,
    RedisClusterException,
    RedisError,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from service.settings import Settings

# What "Redis cannot be reached now" looks like: a dead connection or a timeout, and on a
# cluster a failover in progress (CLUSTERDOWN, TRYAGAIN, a slot nobody serves yet). Callers
# that ride out an outage (the worker's batcher) retry these; the API answers 503.
UNREACHABLE: tuple[type[Exception], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    ClusterDownError,
    TryAgainError,
    SlotNotCoveredError,
    OSError,
)


# Any failure of the store itself (redis-py's cluster client raises some that are not
# RedisErrors): what a loop that must survive Redis trouble catches.
STORE_ERRORS: tuple[type[Exception], ...] = (RedisError, RedisClusterException, OSError)

log = logging.getLogger(__name__)


def survived(what: str, exc: Exception) -> None:
    """Log a failure that a loop which must go on (a tail shard, lease refreshes, a
    worker's control channel) survived: a store error in a line, anything else -- a bug,
    or a client error not mapped yet -- with its traceback. The loop then goes on."""
    if isinstance(exc, STORE_ERRORS):
        log.warning("%s failed: %s", what, exc)
    else:
        log.error("%s failed; going on", what, exc_info=exc)


class _Connection(Connection):
    """redis-py's connection, with one more name for "the connection is gone": on uvloop a
    write to a transport the peer closed (a node that died mid-command, a failover)
    raises ``RuntimeError: unable to perform operation on <TCPTransport closed=True>``
    where asyncio's own loop raises an OSError, which redis-py turns into its
    ``ConnectionError``. Unmapped, it escaped every store-error handler: a 500, an
    ``internal_error`` ending, a dead tail task. Mapped here, once, it is retried on a
    new connection, or the slot map is learnt again, like any lost connection. The same
    for a connection that the cluster client disconnected while another task was still
    sending on it (its slot map re-learnt in a failover): ``AttributeError: 'NoneType'
    object has no attribute 'writelines'`` (seen as a 500 on a resume, on an election).

    Commands are packed by hiredis (C), as redis-py's synchronous client does: its asyncio
    client packs in Python, argument by argument, ~7x slower for a worker's flush of a few
    hundred arguments (the largest cost of the worker's own per token after the socket
    writes). The same bytes; a type hiredis does not take (a bool, None) goes to redis-py's
    packer, which refuses it as before."""

    def pack_command(self, *args: Any) -> list[bytes]:
        first = args[0]  # "CONFIG GET": words of their own, as redis-py sends them
        if (isinstance(first, str) and " " in first) or (
            isinstance(first, bytes) and b" " in first
        ):
            args = (*first.split(), *args[1:])
        try:
            return [hiredis.pack_command(args)]
        except TypeError:
            return super().pack_command(*args)

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except (RuntimeError, AttributeError) as exc:
            raise _lost(exc) from exc

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except (RuntimeError, AttributeError) as exc:
            raise _lost(exc) from exc


def _lost(exc: RuntimeError | AttributeError) -> Exception:
    text = str(exc)
    if isinstance(exc, AttributeError):
        if "'NoneType'" in text:  # its reader / writer: gone with the connection
            return RedisConnectionError(
                f"the connection to Redis was closed under a command: {exc}"
            )
        return exc
    if "closed" in text or "unable to perform operation" in text:
        return RedisConnectionError(f"the connection to Redis is gone: {exc}")
    return exc


@functools.cache
def _driver_info() -> dict[str, Any]:
    try:
        from redis.driver_info import DriverInfo  # redis-py >= 7.1
    except ImportError:  # older: its own per-connection lookup
        return {}
    return {"driver_info": DriverInfo(name="redis-py", lib_version=version("redis"))}


class Backoff:
    """The one retry policy for store calls: wait ``first_s`` after a failure, twice as
    long after each next one up to ``max_s``, and ``first_s`` again after a success. Used
    at every layer that retries: the client's own (a command sent again on a new
    connection: ``client_retry``), the store's loops (a tail shard's reads, the append
    batcher) and the worker's (serving a job, ending one, the recorder). One instance per
    retrying loop (it counts that loop's failures)."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self.first_s = first_s
        self.max_s = max_s
        self.next_s = first_s  # the wait after the next failure

    def failed(self) -> float:
        """The wait after this failure (the next one's doubles)."""
        wait_s, self.next_s = self.next_s, min(self.next_s * 2, self.max_s)
        return wait_s

    def succeeded(self) -> None:
        self.next_s = self.first_s

    async def wait(self) -> None:
        """Sleep out this failure's wait."""
        await asyncio.sleep(self.failed())

    def client_retry(self, retries: int) -> Retry:
        """The same policy as redis-py's: ``retries`` tries at most, the n-th after
        ``min(max_s, first_s * 2**n)``."""
        return Retry(ExponentialBackoff(cap=self.max_s, base=self.first_s), retries=retries)


def _retry() -> dict[str, Any]:
    """A command whose connection died (Redis restarted: every pooled connection is dead)
    is sent again on a new one, a few times within a fraction of a second. Longer outages
    are the callers' to ride out (the worker's batcher; the API answers 503). Safe: the
    scripts that write are idempotent (``create``, ``claim``, ``append`` by position)."""
    return {
        "retry": Backoff(0.02, 0.25).client_retry(3),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }


# A connection error or a timeout makes the cluster client learn the slot map again, at
# most this often (redis-py's default is 1 s): a refresh right after a node's loss still
# finds it serving (its replica not promoted yet), and the next one waited a second --
# the whole of a stream's pause after an immediate promotion (1.2-1.4 s measured). A
# refresh is one CLUSTER SLOTS, however many commands asked for it.
TOPOLOGY_REFRESH_S = 0.2


class _Cluster(RedisCluster):
    """redis-py's cluster client, finding the keys of ``XREAD`` and ``XREADGROUP`` itself.
    Their key spec begins at a keyword (``STREAMS``), which redis-py's commands parser does
    not read: it asked one node (``COMMAND GETKEYS``) on every read -- a round trip more
    per read -- and once that node died, every read failed there, outside the command's
    own routing, so the client never learnt the slot map again: after a failover all of an
    API process's tail shards (a client that sends nothing but reads) and the workers'
    claims went to the dead node for good."""

    async def _determine_slot(self, command: str, *args: Any) -> int:
        keys = stream_keys(command, args)
        if keys is None:
            slot: int = await super()._determine_slot(command, *args)
            return slot
        slots = {self.keyslot(key) for key in keys}
        if len(slots) != 1:
            raise RedisClusterException(f"{command}: all keys must map to one slot ({keys!r})")
        return slots.pop()


def stream_keys(command: Any, args: tuple[Any, ...]) -> list[Any] | None:
    """The stream keys of an ``XREAD`` or ``XREADGROUP`` (``args`` after the command's
    name); None for another command, or one without a well-formed ``STREAMS`` part (then
    redis-py's own parser, and the server, say what is wrong)."""
    name = _text(command).upper()
    if name == "XREAD":
        rest = list(args)
    elif name == "XREADGROUP":
        rest = list(args[3:])  # (GROUP group consumer: either name may be "streams")
    else:
        return None
    for i, arg in enumerate(rest):
        if _text(arg).upper() == "STREAMS":
            tail = rest[i + 1 :]
            if not tail or len(tail) % 2:
                return None
            return tail[: len(tail) // 2]
    return None


def _text(arg: Any) -> str:
    if isinstance(arg, bytes | bytearray | memoryview):
        return bytes(arg).decode("latin-1")
    return arg if isinstance(arg, str) else ""


def _silence(silent_s: float, longest_wait_s: float) -> dict[str, Any]:
    """How long a connection waits on a node that answers nothing: a command is given up
    ``silent_s`` after its own longest wait (a blocked read's ``BLOCK``, ``WAIT``'s
    timeout), and so is a connection attempt (a host that vanished drops SYNs). A frozen or
    partitioned node keeps its sockets open and never answers: without a socket timeout a
    command waits on it for ever (a single node's client had none; a cluster's 5 s, longer
    than its election). TCP keepalive (on) notices a host gone from under an idle pooled
    connection; it cannot notice a frozen process, whose kernel still answers the probes.
    (``silent_s`` is positive: ``Settings`` checks ``LASTEVENT_REDIS_SILENT_S``.)"""
    return {
        "socket_timeout": longest_wait_s + silent_s,
        "socket_connect_timeout": silent_s,
        "socket_keepalive": True,
    }


def seeds(url: str) -> list[str]:
    """The node URLs of ``LASTEVENT_REDIS_URL``: one, or (a cluster) several separated by
    commas; a later one may omit the scheme and credentials (``host:port``): the first's."""
    parts = [p.strip() for p in url.split(",") if p.strip()]
    if not parts:
        raise ValueError("LASTEVENT_REDIS_URL is empty")
    first = urlsplit(parts[0])
    out = [parts[0]]
    for part in parts[1:]:
        if "://" not in part:
            userinfo = first.netloc.rpartition("@")[0]
            part = f"{first.scheme}://{userinfo + '@' if userinfo else ''}{part}"
        out.append(part)
    return out


def connect(
    url: str,
    max_connections: int,
    *,
    wait_s: float = 30.0,
    cluster: bool = False,
    silent_s: float = 2.0,
    longest_wait_s: float = 1.0,
    **kwargs: Any,
) -> Redis:
    """A client of one Redis, or (``cluster``) of the Redis Cluster whose nodes ``url``
    names (one or several seed nodes: a process that starts while a seed is dead still
    finds the cluster through another).

    A cluster client is typed as ``Redis``: it answers the same commands, routed by key
    slot (every multi-key call of this project names keys of one slot: ``keys.py``). Its
    pools are per node and do not wait for a free connection: ``max_connections`` is per
    node and set higher (the tailer's blocked reads hold one each). ``longest_wait_s``: the
    longest a command sent on this client waits by itself (see ``_silence``)."""
    kwargs = {**_driver_info(), **_retry(), **_silence(silent_s, longest_wait_s), **kwargs}
    urls = seeds(url)
    if cluster:
        others = [urlsplit(u) for u in urls[1:]]
        kwargs["startup_nodes"] = [ClusterNode(u.hostname or "", u.port or 6379) for u in others]
        client = _Cluster.from_url(
            urls[0],
            max_connections=max(4 * max_connections, 64),
            topology_refresh_min_interval=TOPOLOGY_REFRESH_S,
            **kwargs,
        )
        # (its constructor names redis-py's own connection class: the nodes it knows and
        # the ones it learns get this one)
        client.nodes_manager.connection_kwargs["connection_class"] = _Connection
        for node in client.nodes_manager.startup_nodes.values():
            node.connection_class = _Connection
        return cast(Redis, client)
    if len(urls) > 1:
        raise ValueError(
            "LASTEVENT_REDIS_URL names several nodes: that is a Redis Cluster's seed list "
            "(set LASTEVENT_REDIS_CLUSTER=1), one URL otherwise"
        )
    pool = BlockingConnectionPool.from_url(
        url, max_connections=max_connections, timeout=wait_s, connection_class=_Connection, **kwargs
    )
    return Redis.from_pool(pool)


def of(settings: Settings, max_connections: int, **kwargs: Any) -> Redis:
    """The client a process of ``settings`` uses for ordinary commands: the longest any of
    them waits by itself is a commit barrier's ``WAIT`` or a blocked claim or outbox read
    (one second)."""
    longest = max(settings.commit_timeout_ms / 1000, 1.0)
    kwargs.setdefault("longest_wait_s", longest)
    return connect(
        settings.redis_url or "",
        max_connections,
        cluster=settings.redis_cluster,
        silent_s=settings.redis_silent_s,
        **kwargs,
    )


async def relearn(redis: Redis, key: str, timeout_s: float | None = None) -> None:
    """After a failure on a connection made outside the cluster client's routing (a
    commit barrier, a subscription, the liveness poll): one command for ``key`` through
    the client, which learns the slot map again on a connection error, a timeout or a
    redirect, so that the next connection goes to whichever node serves the slot now.
    Nothing for a single node (its next connection is made by name: a DNS name that moved
    is followed). Bounded: a node that answers nothing is not waited on past ``timeout_s``."""
    if not is_cluster(redis):
        return
    with contextlib.suppress(*STORE_ERRORS, TimeoutError):
        async with asyncio.timeout(timeout_s):
            await redis.exists(key)


async def refresh_map(redis: Redis) -> bool:
    """Make a cluster client learn its slot map now, whether or not a command failed
    (False: not a cluster, or no node answered)."""
    client: object = redis
    if not isinstance(client, RedisCluster):
        return False
    try:
        await client.nodes_manager.initialize()
    except STORE_ERRORS:
        return False
    return True


def is_cluster(redis: Redis) -> bool:
    client: object = redis
    return isinstance(client, RedisCluster)


async def warm(redis: Redis) -> None:
    """Learn a cluster's slot map now: redis-py's cluster client does so on first use, and a
    burst of first commands at once (an API process's first 50 streams) raced in it,
    closing connections that others were using. Nothing for a single node. If the
    cluster cannot be reached yet, the first command tries again."""
    client: object = redis  # (typed as Redis: see connect)
    if isinstance(client, RedisCluster):
        try:
            await client.initialize()
        except STORE_ERRORS as exc:
            log.warning("cannot reach the Redis Cluster yet: %s", exc)


async def check(redis: Redis) -> str:
    """``"ok"`` if Redis answers, else what went wrong (``/readyz``)."""
    try:
        await redis.ping()
    except STORE_ERRORS as exc:
        return f"error: {exc}"
    return "ok"
