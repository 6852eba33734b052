"""Liveness from connections: a worker is gone when its connection is.

A process killed by ``kill -9`` or the OOM killer has its sockets closed by the kernel,
and Redis drops the connection at once. So each worker holds a connection of its own,
named ``lastevent-worker-<id>`` (``CLIENT SETNAME``: operators see it in
``CLIENT LIST``), to the node that holds the heartbeats, subscribed to a sharded
channel of its own in the heartbeats' slot (``keys.alive``). While it lives, that node
counts one subscriber on the channel; the moment the connection is gone, none
(``PUBSUB SHARDNUMSUB``, one call for every worker). ``Announcer`` keeps the worker's
connection (made again at once after a blip, which re-announces the worker with a
heartbeat); ``Observer`` asks the node; ``Judge`` (no I/O) decides.

The judgment is made only from what one observer saw continuously on one node: a worker
must have been seen subscribed there, then seen without a subscription for a grace
(``worker_connection_grace_s``) long enough for a connection that blipped to come back.
Whatever breaks the observer's own view -- its connection to the node failed or was
made again (a Redis restart, a failover: every worker lost its connection too), a poll
that failed or was late (Redis or the observer stalled) -- forgets everything seen, so
no worker is judged gone because the store went away. A frozen or partitioned worker
keeps its connection: the heartbeat stays for those, unchanged.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError

from service.store import replies
from service.store.keys import Keys
from service.store.pool import Backoff, survived
from service.store.pool import relearn as relearn_key

log = logging.getLogger(__name__)

NAME_PREFIX = "lastevent-worker-"


class Judge:
    """Which workers' connections are gone (no I/O): ``observe`` is told, per poll, which
    workers were asked about and which of them hold their connection."""

    def __init__(self, grace_s: float, max_gap_s: float) -> None:
        self.grace_s = grace_s
        self.max_gap_s = max_gap_s  # polls further apart: the view was broken
        self._seen: set[str] = set()  # connected at some poll since the last reset
        self._absent: dict[str, float] = {}  # seen, then not: since when
        self._last: float | None = None

    def reset(self) -> None:
        """Forget everything: the view was broken (the observer's connection, the node, a
        failed or late poll)."""
        self._seen.clear()
        self._absent.clear()
        self._last = None

    def observe(self, now: float, asked: Iterable[str], connected: Iterable[str]) -> list[str]:
        """One poll at ``now`` (monotonic s): the workers ``asked`` about, those of them
        ``connected``. Returns the workers judged gone now (each once per disappearance)."""
        if self._last is not None and now - self._last > self.max_gap_s:
            self.reset()
        self._last = now
        asked, connected = set(asked), set(connected)
        self._seen &= asked  # a worker no longer known (it stopped cleanly) is forgotten
        gone = []
        for worker in sorted(asked):
            if worker in connected:
                self._seen.add(worker)
                self._absent.pop(worker, None)
            elif worker in self._seen:
                since = self._absent.setdefault(worker, now)
                if now - since >= self.grace_s:
                    gone.append(worker)
                    self._seen.discard(worker)
                    self._absent.pop(worker, None)
        self._absent = {w: t for w, t in self._absent.items() if w in self._seen}
        return gone


def node_connection(redis: Redis, key: str, **overrides: Any) -> tuple[AbstractConnection, str]:
    """A new connection of its own (not a pooled one) to the node that holds ``key``, and
    that node's name."""
    client: object = redis
    if isinstance(client, RedisCluster):
        node = client.get_node_from_key(key)
        if node is None:
            raise RedisConnectionError(f"no node serves {key} now")
        conn: AbstractConnection = node.connection_class(**{**node.connection_kwargs, **overrides})
        return conn, str(node.name)
    pool = redis.connection_pool
    return pool.connection_class(**{**pool.connection_kwargs, **overrides}), "single"


async def relearn(redis: Redis, keys: Keys, timeout_s: float = 3.0) -> None:
    """After a failure on a connection of our own to the heartbeats' node: the cluster
    client learns the slot map again (``pool.relearn``), so the next connection goes to
    the node that serves the heartbeats now."""
    await relearn_key(redis, keys.workers, timeout_s)


class Announcer:
    """A worker's named connection, subscribed to its ``alive`` channel while it lives.
    ``announced`` runs each time the subscription is (re)made (a heartbeat at once).

    The connection is pinged every half ``silent_s``, and given up when the node answered
    nothing for ``silent_s``: a frozen or partitioned node keeps the socket open and says
    nothing, and a subscription that waited on it for ever would never follow the slot to
    the replica that took over (nor would the API processes see the worker there)."""

    def __init__(
        self,
        redis: Redis,
        keys: Keys,
        worker_id: str,
        announced: Callable[[], Awaitable[None]],
        *,
        silent_s: float,  # (Settings' redis_silent_s)
    ) -> None:
        self.redis = redis
        self.keys = keys
        self.silent_s = silent_s
        self.worker_id = worker_id
        self.name = NAME_PREFIX + "".join(c if "!" <= c <= "~" else "_" for c in worker_id)
        self._announced = announced
        self.connected = asyncio.Event()
        self.connections = 0  # subscriptions made (tests, logs)

    async def run(self) -> None:
        backoff = Backoff(0.02, 1.0)
        while True:
            held = self.connections
            try:
                await self._hold()
            except Exception as exc:  # noqa: BLE001 - the connection is made again
                if (
                    self.connections > held or backoff.next_s == backoff.first_s
                ):  # (once per streak)
                    survived("the worker's named connection", exc)
                await relearn(self.redis, self.keys)
            if self.connections > held:
                backoff.succeeded()  # it had been subscribed: try again at once
            await backoff.wait()

    async def _hold(self) -> None:
        channel = self.keys.alive(self.worker_id)
        conn, node = node_connection(self.redis, self.keys.workers, client_name=self.name)
        try:
            await conn.connect()  # type: ignore[no-untyped-call]
            await conn.send_command("SSUBSCRIBE", channel)
            # (redis-py hands a subscription's replies only to a read that asks for them)
            reply = await conn.read_response(timeout=self.silent_s, push_request=True)
            if not isinstance(reply, list) or replies.text(reply[0]).lower() != "ssubscribe":
                raise RedisConnectionError(f"SSUBSCRIBE answered {reply!r}")
            self.connections += 1
            if self.connections > 1:
                log.info("the worker's named connection is back (%s)", node)
            try:
                await self._announced()
            except Exception as exc:  # noqa: BLE001 - the next heartbeat says it
                survived("a heartbeat after connecting", exc)
            self.connected.set()  # (subscribed and announced: an observer sees both)
            await self._listen(conn, node)
        finally:
            self.connected.clear()
            await conn.disconnect()

    async def _listen(self, conn: AbstractConnection, node: str) -> None:
        """Until the slot moves (``sunsubscribe``) or the node is silent for ``silent_s``
        (raises). Nothing is published: a reply is a pong, the slot moving, or an error."""
        heard = time.monotonic()
        while True:
            message = await conn.read_response(timeout=self.silent_s / 2, push_request=True)
            if message is None:  # (the wait ran out)
                if time.monotonic() - heard >= self.silent_s:
                    raise RedisConnectionError(
                        f"{node} answered nothing for {self.silent_s:g} s (frozen, partitioned)"
                    )
                await conn.send_command("PING")
                continue
            heard = time.monotonic()
            if isinstance(message, list) and message:
                kind = replies.text(message[0]).lower()
                if kind == "sunsubscribe":  # the slot moved: follow it to its node
                    log.info("the heartbeats' slot moved from %s", node)
                    await relearn(self.redis, self.keys)
                    return


class Observer:
    """Asks the node that holds the heartbeats which workers hold their connection, on a
    connection of its own: any failure closes it, and the caller forgets what it saw."""

    def __init__(self, redis: Redis, keys: Keys, *, timeout_s: float = 1.0) -> None:
        self.redis = redis
        self.keys = keys
        self.timeout_s = timeout_s
        self._conn: AbstractConnection | None = None

    async def poll(self, asked: list[str]) -> tuple[list[str], set[str]]:
        """The workers with a heartbeat now, and which of ``asked`` hold their connection.
        Raises on any failure (the connection is closed: the view is broken)."""
        try:
            if self._conn is None:
                self._conn, _ = node_connection(
                    self.redis, self.keys.workers, socket_timeout=self.timeout_s
                )
                await self._conn.connect()  # type: ignore[no-untyped-call]
            conn = self._conn
            commands: list[tuple[Any, ...]] = [("HKEYS", self.keys.workers)]
            if asked:
                channels = [self.keys.alive(w) for w in asked]
                commands.append(("PUBSUB", "SHARDNUMSUB", *channels))
            await conn.send_packed_command(conn.pack_commands(commands))
            known = [replies.text(w) for w in await conn.read_response()]
            connected: set[str] = set()
            if asked:
                counts = await conn.read_response()
                for worker, n in zip(asked, counts[1::2], strict=True):
                    if int(n) > 0:
                        connected.add(worker)
            return known, connected
        except Exception:
            await self.close()
            await relearn(self.redis, self.keys)
            raise
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        if self._conn is not None:
            conn, self._conn = self._conn, None
            await conn.disconnect()
